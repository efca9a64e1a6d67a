"""OpenAI request parsing (refused, unknown and bad parameters are named), choices, usage and
the sampler's logprobs; no model."""
import pytest
import torch

from kiln.runtime.engine import Usage
from kiln.runtime.sampling import Sampler, SamplingParams
from kiln.runtime.server.openai_protocol import (OpenAIError, chat_messages, parse_chat,
                                            parse_completion, usage_json)
from tests.runtime_helpers import byte_tokenizer

pytestmark = pytest.mark.unit
TOK = byte_tokenizer()
HI = [{"role": "user", "content": "hi"}]


def refusal(fn, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(body)
    assert e.value.status == 400 and e.value.param and e.value.param in e.value.message
    return e.value


def completion(body):
    return parse_completion({"model": "m", "prompt": "ab", **body}, TOK)


def chat(body):
    return parse_chat({"model": "m", "messages": HI, **body}, TOK, 256)


@pytest.mark.parametrize("body", [{"functions": [{}]}, {"function_call": "auto"},
                                  {"logit_bias": {"1": 2}}, {"audio": {"voice": "x"}},
                                  {"modalities": ["audio"]}, {"reasoning_effort": "low"}])
def test_unsupported_parameters_are_refused_by_name(body):
    (name,) = body
    e = refusal(chat, body)
    assert e.param == name and e.code == "unsupported_parameter"


def test_harmless_values_of_refused_parameters_pass():
    job = chat({"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "modalities": ["text"], "logit_bias": {}, "user": "u", "metadata": {"a": "b"},
                "store": False, "parallel_tool_calls": True})
    assert job.n == 1 and not job.stream


def test_unknown_and_mistyped_parameters_are_named():
    assert refusal(chat, {"frobnicate": 1}).code == "unknown_parameter"
    assert refusal(completion, {"temperature": "hot"}).param == "temperature"
    assert refusal(completion, {"temperature": 2.5}).param == "temperature"
    assert refusal(completion, {"max_tokens": 0}).param == "max_tokens"
    assert refusal(chat, {"max_completion_tokens": 0}).param == "max_completion_tokens"
    assert refusal(chat, {"top_logprobs": 2}).param == "top_logprobs"       # needs logprobs
    assert refusal(completion, {"n": 0}).param == "n"
    assert refusal(completion, {"echo": True}).param == "echo"
    assert refusal(completion, {"stream_options": {"include_usage": True}}).param == \
        "stream_options"
    with pytest.raises(OpenAIError) as e:
        parse_completion({"prompt": "x"}, TOK)
    assert e.value.param == "model" and e.value.code == "missing_parameter"


def test_messages():
    assert chat_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]}]) \
        == [{"role": "system", "content": "a\nb"}]
    for bad, param in (([{"role": "robot", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}],
                        "messages[0].content[0]"),
                       ([{"role": "assistant", "tool_calls": [{"id": "1"}]}],
                        "messages[0].tool_calls")):
        with pytest.raises(OpenAIError) as e:
            chat_messages(bad)
        assert e.value.param == param


def test_choices_prompts_and_defaults():
    job = completion({"prompt": ["ab", "cde"], "n": 2, "seed": 5, "stop": "x",
                      "max_tokens": 3, "logprobs": 2})
    assert [len(ids) for ids, _ in job.choices] == [2, 2, 3, 3]
    assert [p.seed for _, p in job.choices] == [5, 6, 5, 6]      # distinct, reproducible
    assert job.choices[0][1].stop == ("x",) and job.choices[0][1].logprobs == 2
    assert completion({}).choices[0][1].max_tokens == 16          # OpenAI's default
    c = chat({"logprobs": True, "top_logprobs": 3, "stream": True,
              "stream_options": {"include_usage": True}})
    ids, p = c.choices[0]
    assert p.max_tokens == 256 - len(ids) and p.logprobs == 3     # the rest of the context
    assert c.stream and c.include_usage
    assert completion({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]


def test_usage_counts_each_prompt_once():
    u = usage_json([Usage(10, 8, 3), Usage(10, 10, 4), Usage(5, 0, 1), Usage(5, 5, 1)], n=2)
    assert u == {"prompt_tokens": 15, "completion_tokens": 9, "total_tokens": 24,
                 "prompt_tokens_details": {"cached_tokens": 8}}
    u = usage_json([Usage(10, 8, 3, 4, 1), Usage(10, 10, 4, 6, 3)], n=2)   # speculated
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 4,
                                              "rejected_prediction_tokens": 6}


def test_sampler_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, 50)
    lps = Sampler.logprobs(logits, [4, 7, 9], [0, 2, 5])
    ref = torch.log_softmax(logits, -1)
    for row, (lp, t, k) in enumerate(zip(lps, [4, 7, 9], [0, 2, 5])):
        assert lp.token_id == t and lp.logprob == pytest.approx(ref[row, t].item(), abs=1e-6)
        assert len(lp.top) == k
        assert [i for i, _ in lp.top] == ref[row].topk(k).indices.tolist()
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
