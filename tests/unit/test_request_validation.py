"""Validation at the API boundary (no model): NaN and infinities in every float field and
out-of-range seeds are refused by SamplingParams (all three APIs build one) and by the
KServe decoder; the per-request caps of RequestLimits."""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kpb

from kiln.runtime.sampling import SEED_MAX, SEED_MIN, SamplingParams, SamplingState
from kiln.runtime.server.errors import ServiceError, classify
from kiln.runtime.server.kserve import parse
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.openai_http import _check_body, _check_logprobs
from kiln.runtime.server.openai_protocol import OpenAIError, parse_completion
from kiln.runtime.server.tensors import encode_bytes
from tests.runtime_helpers import byte_tokenizer

pytestmark = pytest.mark.unit

FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")
BAD_FLOATS = (math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", BAD_FLOATS)
def test_non_finite_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("seed", [2**64, SEED_MIN - 1, 2**70])
def test_seeds_outside_torch_range_are_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2**63, SEED_MAX])
def test_seeds_inside_torch_range_seed_a_generator(seed):
    state = SamplingState.create(SamplingParams(seed=seed))
    assert state.generator is not None


def _kserve(**floats):
    r = kpb.ModelInferRequest(model_name="m", id="1")
    tensors = dict(text_input=("BYTES", [b"hi"]), max_tokens=("INT32", [4]),
                   **{k: ("FP32", [v]) for k, v in floats.items()})
    for name, (dt, values) in tensors.items():
        r.inputs.add(name=name, datatype=dt, shape=[1, 1])
        r.raw_input_contents.append(encode_bytes(values) if dt == "BYTES" else
                                    np.asarray(values, {"INT32": "<i4", "FP32": "<f4"}[dt])
                                    .tobytes())
    return r


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty", "length_penalty"])
@pytest.mark.parametrize("value", BAD_FLOATS)
def test_kserve_non_finite_floats_are_invalid_argument(name, value):
    with pytest.raises(ServiceError) as e:
        parse(_kserve(**{name: value}), 100)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.message


TOK = byte_tokenizer()


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", BAD_FLOATS)
def test_openai_non_finite_floats_are_400(field, value):
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "hi", field: value}, TOK)
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_openai_seed_out_of_range_is_400(seed):
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "seed": seed}, TOK)
    assert e.value.status == 400 and e.value.param == "seed"


def test_openai_n_choices_of_the_largest_seed_wrap():
    job = parse_completion({"model": "m", "prompt": "hi", "seed": SEED_MAX, "n": 3}, TOK)
    assert [p.seed for _, p in job.choices] == [SEED_MAX, 0, 1]


def test_limits_refuse_long_lists_and_prompts():
    lim = RequestLimits(max_stop=3, max_bad_words=2, max_word_bytes=8, max_messages=2,
                        max_prompt_bytes=100)
    lim.check_params(SamplingParams(stop=("a", "b", "c"), bad_words=("x", "y")))
    for params, what in ((SamplingParams(stop=tuple("abcd")), "stop"),
                         (SamplingParams(stop_token_ids=(1, 2, 3, 4)), "stop_token_ids"),
                         (SamplingParams(bad_words=("x",), bad_token_ids=(1, 2)), "bad_words"),
                         (SamplingParams(stop=("123456789",)), "longer than 8 bytes")):
        with pytest.raises(ServiceError) as e:
            lim.check_params(params)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message
    lim.check_prompt("x" * 100, 10)
    with pytest.raises(ServiceError, match="101 bytes"):
        lim.check_prompt("x" * 101, 10)
    with pytest.raises(ServiceError, match="messages has 3 entries"):
        lim.check_prompt([{"role": "user", "content": "a"}] * 3, 10)
    with pytest.raises(ServiceError, match="max_input_len"):
        lim.check_prompt(list(range(11)), 10)
    # the default prompt cap follows the plan: 64 bytes a token, at least 1 MiB
    assert RequestLimits().prompt_bytes(100) == 2**20
    assert RequestLimits().prompt_bytes(100_000) == 6_400_000
    with pytest.raises(ValueError, match="max_stop"):
        RequestLimits(max_stop=0)


def test_prompt_cap_counts_everything_the_chat_template_sees():
    """Not only contents: roles (kiln.v1 takes any), names, tool calls' arguments, tools."""
    lim = RequestLimits(max_prompt_bytes=100)
    big = "x" * 101
    lim.check_prompt([{"role": "user", "content": "x" * 80}], 10)   # keys count too
    for message in ({"role": big, "content": ""},
                    {"role": "user", "content": "", "name": big},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "1", "type": "function",
                         "function": {"name": "f", "arguments": big}}]},
                    {"role": "user", "content": [{"type": "text", "text": big}]}):
        with pytest.raises(ServiceError, match="bytes"):
            lim.check_prompt([message], 10)
    tools = [{"type": "function", "function": {"name": "f", "description": big,
                                               "parameters": {"type": "object"}}}]
    with pytest.raises(ServiceError, match="bytes"):
        lim.check_prompt([{"role": "user", "content": "hi"}], 10, tools)
    with pytest.raises(OpenAIError) as e:       # the HTTP API's check, before tokenizing
        _check_body({"messages": [{"role": "user", "content": "hi"}], "tools": tools},
                    lim, 10)
    assert e.value.status == 400 and e.value.code == "limit_exceeded"
    deep = [[]]
    for _ in range(100_000):                    # counted without recursion
        deep = [deep]
    with pytest.raises(ServiceError, match="bytes"):
        lim.check_prompt([{"role": "user", "content": "hi", "x": deep, "y": big}], 10)


def test_logprob_entries_of_a_whole_response_are_capped():
    lim = RequestLimits(max_logprob_entries=1000)
    ok = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 10, "n": 4,
                           "logprobs": 5}, TOK)                        # 4 x 10 x 6 = 240
    _check_logprobs(ok, lim)
    big = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 100, "n": 2,
                            "logprobs": 5}, TOK)                       # 2 x 100 x 6 = 1200
    with pytest.raises(OpenAIError, match="1200 logprob entries"):
        _check_logprobs(big, lim)
    streamed = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 100, "n": 2,
                                 "logprobs": 5, "stream": True}, TOK)
    _check_logprobs(streamed, lim)              # sent token by token: not held at once


def test_lone_surrogate_prompt_and_template_refusal_are_invalid_requests():
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "ok \ud800"}, TOK)
    assert e.value.status == 400 and "surrogate" in e.value.message
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": ["fine", "\udfff"]}, TOK)
    assert e.value.status == 400
    # what the gRPC services answer for the engine's refusals (kiln.v1 chat, Tokenize)
    for bad in (lambda: TOK.encode("\ud800"),
                lambda: TOK.apply_chat_template([{"role": "tool", "content": "x"}])):
        with pytest.raises(Exception) as e:
            bad()
        assert classify(e.value).code == grpc.StatusCode.INVALID_ARGUMENT, e.value


@pytest.mark.parametrize("k", [-1, True, 1.5])
def test_max_draft_tokens_must_be_a_count(k):
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SamplingParams(max_draft_tokens=k)


def test_max_draft_tokens_reaches_sampling_params_in_every_api():
    from kiln.runtime.server.native import sampling_params
    from kiln.runtime.server.proto import kiln_pb2 as pb

    job = parse_completion({"model": "m", "prompt": "hi", "max_draft_tokens": 2}, TOK)
    assert job.choices[0][1].max_draft_tokens == 2
    assert parse_completion({"model": "m", "prompt": "hi"}, TOK).choices[0][1] \
        .max_draft_tokens is None
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "max_draft_tokens": -1}, TOK)
    assert e.value.status == 400 and e.value.param == "max_draft_tokens"
    assert sampling_params(pb.SamplingParams(max_draft_tokens=0)).max_draft_tokens == 0
    assert sampling_params(pb.SamplingParams()).max_draft_tokens is None
    r = _kserve()
    r.inputs.add(name="max_draft_tokens", datatype="INT32", shape=[1, 1])
    r.raw_input_contents.append(np.asarray([3], "<i4").tobytes())
    assert parse(r, 100).params.max_draft_tokens == 3
    r.raw_input_contents[-1] = np.asarray([-2], "<i4").tobytes()
    with pytest.raises(ServiceError) as e:
        parse(r, 100)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_draft_tokens" in e.value.message
