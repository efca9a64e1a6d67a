"""Constrained decoding without a model: constraints compile (or are refused with the reason),
bitmasks allow exactly what the grammar allows, the sampler obeys them row by row, and the
OpenAI tools/response_format parameters, kiln.v1's and KServe's fields become the right
constraints and tool calls."""
import json
import threading
from concurrent.futures import CancelledError

import grpc
import pytest
import torch

from kiln.runtime.guided import (CompileBusy, GrammarCache, GuidedDecoding, GuidedLimits, Masker,
                                 apply_bitmask)
from kiln.runtime.sampling import Sampler, SamplingParams, SamplingState
from kiln.runtime.server.errors import ServiceError
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.openai_protocol import ChoiceState, OpenAIError, final_json, parse_chat, \
    parse_completion
from kiln.runtime.server.openai_tools import parse_tools, render_messages
from tests.runtime_helpers import byte_tokenizer

pytestmark = pytest.mark.unit
TOK = byte_tokenizer()
EOS = TOK.eos_token_ids[0]
V = TOK.vocab_size


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(TOK.to_json(), EOS, V)


def walk(cache, g: GuidedDecoding, text: str):
    """Feed text byte by byte (the byte tokenizer's ids are the bytes) -> the guide."""
    guide = cache.guide(g)
    for b in text.encode():
        guide.advance(b)
    return guide


def test_constraints_accept_what_they_describe_and_nothing_else(cache):
    schema = GuidedDecoding.json_schema({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["a"],
        "additionalProperties": False})
    assert walk(cache, schema, '{"a":3}').done
    assert walk(cache, schema, '{"a":7}').error is not None           # out of bounds
    assert walk(cache, schema, '{"b":1}').error is not None           # not a property
    regex = GuidedDecoding("regex", r"[a-c]{2}-\d+")
    g = walk(cache, regex, "ab-12")
    assert g.error is None and not g.done                            # more digits may follow
    assert walk(cache, regex, "ad").error is not None
    choice = GuidedDecoding("choice", choices=("red", "green"))
    assert walk(cache, choice, "green").done
    assert walk(cache, choice, "gray").error is not None
    lark = GuidedDecoding("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/')
    assert walk(cache, lark, "x42").done
    gbnf = GuidedDecoding("grammar", 'root ::= "y" [0-9] [0-9]')
    assert walk(cache, gbnf, "y07").done and walk(cache, gbnf, "x").error is not None
    assert walk(cache, GuidedDecoding("json_object"), '{"k":[1,2]}').done
    assert walk(cache, GuidedDecoding("json_object"), '[1]').error is not None


@pytest.mark.parametrize("g, reason", [
    (GuidedDecoding.json_schema({"type": "strin"}), "strin"),
    (GuidedDecoding.json_schema({"$ref": "#/nowhere"}), "nowhere"),
    (GuidedDecoding("regex", "[0-9"), "regex"),
    (GuidedDecoding("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_bad_constraints_are_refused_with_the_reason(cache, g, reason):
    with pytest.raises(ValueError) as e:
        cache.guide(g)
    assert reason in str(e.value) and str(e.value).startswith("invalid ")


def test_constraint_arguments_are_validated():
    for bad in (lambda: GuidedDecoding("xml", "x"), lambda: GuidedDecoding("regex", ""),
                lambda: GuidedDecoding("choice", choices=()),
                lambda: GuidedDecoding.json_schema("{not json"),
                lambda: GuidedDecoding.json_schema([1])):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError) as e:
        SamplingParams(guided={"type": "json"})
    assert "guided" in str(e.value)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(cache):
    g = GuidedDecoding("choice", choices=("ab", "ac"))
    one, two = cache.guide(g), cache.guide(g)
    assert one.matcher is not two.matcher
    one.advance(ord("a"))
    one.advance(ord("b"))
    assert one.done and not two.done and len(cache._cache) >= 1
    two.advance(ord("a"))
    two.advance(ord("c"))
    assert two.done


def test_bitmask_allows_exactly_the_grammars_next_tokens(cache):
    guides = [cache.guide(GuidedDecoding("choice", choices=("ab", "cd"))),
              cache.guide(GuidedDecoding("regex", "[xyz]"))]
    bm = Masker(V, 4).fill(guides)
    logits = torch.zeros(3, V)
    apply_bitmask(logits, [0, 2], bm)
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert allowed[0] == {ord("a"), ord("c")}
    assert allowed[1] == set(range(V))                               # an unconstrained row
    assert allowed[2] == {ord("x"), ord("y"), ord("z")}
    guides[0].advance(ord("c"))
    guides[0].advance(ord("d"))
    logits = torch.zeros(1, V)
    apply_bitmask(logits, [0], Masker(V, 1).fill(guides[:1]))
    # a complete grammar allows only the end of the sequence
    assert torch.nonzero(logits[0] > float("-inf")).flatten().tolist() == [EOS]


def test_sampler_obeys_masks_and_leaves_other_rows_alone(cache):
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    states = [SamplingState.create(SamplingParams(temperature=t, seed=s))
              for t, s in ((0, None), (0, None), (1.0, 3), (1.0, 4))]
    free = Sampler()(logits, states, [[1]] * 4, [1] * 4)
    guides = [cache.guide(GuidedDecoding("regex", "[0-9]")) for _ in range(2)]
    bm = Masker(V, 4).fill(guides)
    states = [SamplingState.create(SamplingParams(temperature=t, seed=s))
              for t, s in ((0, None), (0, None), (1.0, 3), (1.0, 4))]
    toks = Sampler()(logits, states, [[1]] * 4, [1] * 4, ([1, 3], bm))
    assert chr(toks[1]).isdigit() and chr(toks[3]).isdigit()
    assert toks[0] == free[0] and toks[2] == free[2]   # unconstrained rows: the same tokens


# ---- the OpenAI parameters --------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}


def chat(body):
    return parse_chat({"model": "m", "messages": HI, **body}, TOK, 4096)


def test_response_format_and_guided_parameters_become_constraints():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    job = chat({"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": schema,
                                                    "strict": True}}})
    assert job.choices[0][1].guided == GuidedDecoding.json_schema(schema)
    assert chat({"response_format": {"type": "json_object"}}).choices[0][1].guided.kind == \
        "json_object"
    assert chat({"response_format": {"type": "text"}}).choices[0][1].guided is None
    c = parse_completion({"model": "m", "prompt": "x", "guided_regex": "a+"}, TOK)
    assert c.choices[0][1].guided == GuidedDecoding("regex", "a+")
    assert chat({"guided_choice": ["a", "b"]}).choices[0][1].guided.choices == ("a", "b")
    assert chat({"guided_grammar": 'start: "a"'}).choices[0][1].guided.kind == "grammar"
    assert chat({"guided_json": json.dumps(schema)}).choices[0][1].guided.kind == "json"
    for body, param in (({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"guided_choice": []}, "guided_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                              "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": "required",
                          "guided_regex": "a"}, "guided_regex")):
        with pytest.raises(OpenAIError) as e:
            chat(body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


def test_tool_choice_constraints_and_tool_calls():
    named = chat({"tools": [WEATHER, TIME],
                  "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    # strict function calling: an object without additionalProperties has only its properties
    assert json.loads(named.choices[0][1].guided.spec) == {
        **WEATHER["function"]["parameters"], "additionalProperties": False}
    required = chat({"tools": [WEATHER, TIME], "tool_choice": "required",
                     "parallel_tool_calls": False})
    schema = json.loads(required.choices[0][1].guided.spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == \
        ["weather", "time"]
    auto = chat({"tools": [WEATHER]})
    assert auto.choices[0][1].guided is None and auto.tools.choice == "auto"
    assert chat({"tools": [WEATHER], "tool_choice": "none"}).tools is None

    def reply(job, text):
        st = ChoiceState()
        st.text, st.finish_reason = text, "stop"
        return final_json(job, [st], TOK, "m", "fp")["choices"][0]
    r = reply(required, '[{"name":"time","parameters":{"tz":"UTC"}}]')
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    assert r["message"]["tool_calls"][0]["function"] == {"name": "time",
                                                        "arguments": '{"tz": "UTC"}'}
    r = reply(named, '{"city":"Oslo"}')
    assert r["message"]["tool_calls"][0]["function"] == {"name": "weather",
                                                        "arguments": '{"city":"Oslo"}'}
    r = reply(auto, '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n'
                    '</tool_call>')
    assert json.loads(r["message"]["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Rome"}
    for text in ("It is sunny.", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'):
        r = reply(auto, text)
        assert r["finish_reason"] == "stop" and r["message"]["content"] == text


def test_tools_reach_the_prompt_natively_or_through_the_fallback():
    tools = parse_tools([WEATHER], "auto")
    history = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"}]
    msgs, extra = render_messages(history, tools, "{{ messages }}")    # no tools section
    assert extra == {} and msgs[0]["role"] == "system" and '"weather"' in msgs[0]["content"]
    assert "<tool_call>" in msgs[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    msgs, extra = render_messages(history, tools, "{% for t in tools %}{% endfor %}")
    assert extra["tools"][0]["function"]["name"] == "weather" and msgs[0] == HI[0]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    ids = chat({"tools": [WEATHER], "messages": history}).prompts[0]
    assert '"weather"' in TOK.decode(ids)


def test_kiln_v1_and_kserve_fields_become_constraints():
    from kiln.runtime.server import kserve
    from kiln.runtime.server.errors import ServiceError
    from kiln.runtime.server.native import sampling_params
    from kiln.runtime.server.proto import kiln_pb2 as pb
    from tests.unit.test_kserve_parse import BASE, req

    sp = sampling_params(pb.SamplingParams(guided=pb.GuidedDecoding(
        choice=pb.Choices(choices=["a", "b"]))))
    assert sp.guided == GuidedDecoding("choice", choices=("a", "b"))
    assert sampling_params(pb.SamplingParams(guided=pb.GuidedDecoding(json_object=True))) \
        .guided.kind == "json_object"
    assert sampling_params(pb.SamplingParams()).guided is None
    for bad in (pb.GuidedDecoding(), pb.GuidedDecoding(json_schema="{nope"),
                pb.GuidedDecoding(choice=pb.Choices())):
        with pytest.raises(ServiceError):
            sampling_params(pb.SamplingParams(guided=bad))

    job = kserve.parse(req(**BASE, guided_regex=("BYTES", [1, 1], [b"[0-9]+"])), 100)
    assert job.params.guided == GuidedDecoding("regex", "[0-9]+")
    job = kserve.parse(req(**BASE, guided_choice=("BYTES", [1, 2], [b"x", b"y"])), 100)
    assert job.params.guided.choices == ("x", "y")
    job = kserve.parse(req(**BASE, guided_json=("BYTES", [1, 1], [b'{"type": "object"}'])), 100)
    assert job.params.guided.kind == "json"
    for extra in (dict(guided_regex=("BYTES", [1, 1], [b"a"]),
                       guided_grammar=("BYTES", [1, 1], [b'start: "a"'])),
                  dict(guided_json=("BYTES", [1, 1], [b"{not json"]))):
        with pytest.raises(ServiceError) as e:
            kserve.parse(req(**BASE, **extra), 100)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


# ---- bounds: the compile pool, the cache, llguidance's limits, the step budget ----------------
def test_constraint_text_and_choices_are_capped_before_compiling():
    limits = RequestLimits(max_guided_bytes=1000, max_guided_choices=3)
    big = GuidedDecoding.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(100)}})
    for g, word in ((big, "1000"), (GuidedDecoding("regex", "a" * 1001), "1000"),
                    (GuidedDecoding("choice", choices=("x", "y", "z", "w")), "at most 3")):
        with pytest.raises(ServiceError) as e:
            limits.check_params(SamplingParams(guided=g))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.message
    limits.check_params(SamplingParams(guided=GuidedDecoding("regex", "a" * 1000)))


def _drain(cache: GrammarCache) -> None:
    """Wait until every compile queued so far on a one-thread pool has run."""
    cache._pool.submit(lambda: None).result(60)


def test_compiles_run_on_their_own_bounded_pool_and_a_caller_that_leaves_withdraws():
    cache = GrammarCache(TOK.to_json(), EOS, V, GuidedLimits(compile_threads=1,
                                                             max_compiles_waiting=1))
    hold = threading.Event()
    cache._pool.submit(hold.wait, 60)            # the one compile thread is busy
    one = cache.submit(GuidedDecoding("regex", "one"))
    same = cache.submit(GuidedDecoding("regex", "one"))      # joins the queued compile
    with pytest.raises(CompileBusy):
        cache.submit(GuidedDecoding("regex", "two"))          # the queue holds one
    assert one.cancel() and same.cancel()                     # both callers leave
    two = cache.submit(GuidedDecoding("regex", "two"))        # room again: "one" is dropped
    hold.set()
    assert isinstance(two.result(60).matcher, object)
    _drain(cache)
    assert len(cache._cache) == 1                             # "one" never compiled
    with pytest.raises(CancelledError):
        one.result(0)
    cache.close()


def test_a_compile_past_its_deadline_is_refused_and_cached_for_the_next_caller():
    cache = GrammarCache(TOK.to_json(), EOS, V, GuidedLimits(compile_threads=1,
                                                             compile_timeout_s=1e-9))
    started, release = threading.Event(), threading.Event()
    compile_ = cache._compile

    def held(g):                      # the compile runs until the callers have left
        started.set()
        assert release.wait(60)
        return compile_(g)

    cache._compile = held
    g = GuidedDecoding.json_schema({"type": "object", "properties": {
        f"k{i}": {"type": "string", "maxLength": 9} for i in range(200)}})
    first = cache.submit(g)
    assert started.wait(60)           # compiling: a started compile outlives its callers
    with pytest.raises(ValueError) as e:
        cache.guide(g)                # joins it, and its deadline passes
    assert "--guided-compile-timeout" in str(e.value)
    assert first.cancel()             # the first caller leaves too
    release.set()
    _drain(cache)
    assert cache.guide(g).matcher is not None                 # from the cache: no wait
    cache.close()


def test_the_grammar_cache_is_bounded_in_bytes_and_keyed_by_digest():
    cap = 3 * 2**20
    cache = GrammarCache(TOK.to_json(), EOS, V, GuidedLimits(cache_bytes=cap))
    for i in range(30):
        cache.guide(GuidedDecoding("regex", f"[a-z]{{{i + 1}}}x" + "y" * 2000))
    assert 0 < cache.cached_bytes <= cap and len(cache._cache) < 30
    assert all(len(k) == 32 for k in cache._cache)            # a digest, not the spec text
    huge = GuidedDecoding("regex", "(" + "|".join(f"w{i}" for i in range(5000)) + ")")
    before = dict(cache._cache)
    cache.guide(huge)                                         # larger than the whole bound
    assert dict(cache._cache).keys() == before.keys()
    cache.close()


def test_llguidance_parser_limits_are_passed():
    g = GuidedDecoding.json_schema({"type": "object", "properties": {
        f"k{i}": {"type": "integer"} for i in range(50)}})
    small = GrammarCache(TOK.to_json(), EOS, V, GuidedLimits(max_grammar_size=100))
    with pytest.raises(ValueError) as e:
        small.guide(g)
    assert str(e.value).startswith("invalid JSON schema")
    assert GrammarCache(TOK.to_json(), EOS, V).guide(g).error is None


def test_a_deeply_nested_schema_is_a_value_error_on_every_api():
    from kiln.runtime.server import kserve
    from kiln.runtime.server.native import sampling_params
    from kiln.runtime.server.proto import kiln_pb2 as pb
    from tests.unit.test_kserve_parse import BASE, req

    deep = "[" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        GuidedDecoding.json_schema(deep)
    with pytest.raises(ServiceError) as e:
        kserve.parse(req(**BASE, guided_json=("BYTES", [1, 1], [deep.encode()])), 100)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as e:
        sampling_params(pb.SamplingParams(guided=pb.GuidedDecoding(json_schema=deep)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "x", "guided_json": deep}, TOK)
    assert e.value.status == 400
