"""Tool calls without a model: the constraint for tool arguments is strict function calling
(only declared properties, each once, one call unless parallel calls are on), replies are read
in linear time, and a reply cut inside a call is reported as cut, never as content."""
import json
import subprocess
import sys
from typing import Optional

import pytest

from kiln.runtime.guided import GrammarCache
from kiln.runtime.server.openai_protocol import ChoiceState, OpenAIError, chunk_json, envelope, \
    final_json, parse_chat
from kiln.runtime.server.openai_tools import MAX_TOOL_CALLS, parse_tools, \
    strict_parameters
from kiln.runtime.streams import RequestOutput, Timings, Usage
from tests.runtime_helpers import byte_tokenizer

pytestmark = pytest.mark.unit
TOK = byte_tokenizer()

# The function of the report: both properties required, no additionalProperties.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
CALL = '{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}'


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(TOK.to_json(), TOK.eos_token_ids[0], TOK.vocab_size)


def chat(**body):
    return parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 96,
                       **body}, TOK, 4096)


def fed(cache, job, text: str) -> tuple[Optional[int], bool]:
    """Feed `text` (one token per byte) through the request's matcher -> (the index of the
    first token it refuses, or None; whether the grammar is then complete)."""
    guide = cache.guide(job.choices[0][1].guided)
    for n, b in enumerate(text.encode()):
        guide.advance(b)
        if guide.error:
            return n, False
    return None, guide.done


def test_required_tool_call_allows_only_the_declared_keys_each_once(cache):
    job = chat(tool_choice="required")                  # parallel_tool_calls: the default
    head = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"'
    assert fed(cache, job, f"[{CALL}]") == (None, True)
    for bad in (',"temperature":"25C"', ',"unit":"celsius"', ',"city":"Rome"'):
        assert fed(cache, job, head + bad) == (len(head), False), bad   # not even the ,
    assert fed(cache, job, '[{"name":"get_weather","parameters":{"temperature"')[0] == 38
    again = '[{"name":"get_weather","parameters":{"city":"Paris","c'
    assert fed(cache, job, again)[0] == len(again) - 1                 # city twice
    # parallel calls on: the model may start another call, which is as strict as the first
    assert fed(cache, job, f"[{CALL},{CALL}]") == (None, True)
    second = f"[{CALL},{head[1:]}"
    assert fed(cache, job, second + ',"temperature"')[0] == len(second)
    many = "[" + ",".join([CALL] * MAX_TOOL_CALLS)
    assert fed(cache, job, many + ",")[0] == len(many)                 # at most 128 calls
    assert fed(cache, job, many + "]") == (None, True)
    # parallel calls off: the array closes after the call
    single = chat(tool_choice="required", parallel_tool_calls=False)
    assert fed(cache, single, f"[{CALL},")[0] == len(CALL) + 1
    assert fed(cache, single, f"[{CALL}]") == (None, True)


def test_named_tool_choice_arguments_are_strict(cache):
    job = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args = '{"city":"Paris","unit":"celsius"'
    assert fed(cache, job, args + "}") == (None, True)
    assert fed(cache, job, args + ',"temperature":1}')[0] == len(args)
    assert fed(cache, job, '{"city":"Paris","city"')[0] == 17


def test_strict_parameters_close_objects_unless_the_schema_opens_them():
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "a": inner, "b": {"type": "array", "items": inner},
        "c": {"type": "object", "additionalProperties": True},
        "d": {"type": "object", "additionalProperties": {"type": "integer"}},
        "e": {"anyOf": [inner, {"type": "null"}]},
        "f": {"allOf": [inner, {"properties": {"y": {"type": "integer"}}}]}},
        "$defs": {"p": inner}}
    out = strict_parameters(schema)
    closed = {**inner, "additionalProperties": False}
    assert out["additionalProperties"] is False and out["$defs"]["p"] == closed
    assert out["properties"]["a"] == closed and out["properties"]["b"]["items"] == closed
    assert out["properties"]["c"] == schema["properties"]["c"]             # opened: kept
    assert out["properties"]["d"] == schema["properties"]["d"]
    assert out["properties"]["e"]["anyOf"] == [closed, {"type": "null"}]
    assert out["properties"]["f"] == schema["properties"]["f"]   # allOf: closing breaks it
    assert schema["properties"]["a"] == inner                              # a copy
    assert strict_parameters({"type": "object"}) == {"type": "object",
                                                     "additionalProperties": False}


# Replies that a backtracking regex over the whole reply takes minutes (or a RecursionError)
# to read; `guided_regex` with tool_choice auto can force any of them. Read in a child process
# that imports only the tool-call module.
_READ = """
import json, sys
from kiln.runtime.server.openai_tools import MAX_TOOL_REPLY_CHARS, parse_tools
replies = {
    "spaces": "<tool_call>" + " " * 20_000,
    "spaces_x": "<tool_call>" + " " * 20_000 + "x",
    "tags": "<tool_call>" * 20_000,
    "nested": "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "long": "<tool_call>" + " " * MAX_TOOL_REPLY_CHARS + "</tool_call>",
}
tools = parse_tools([json.loads(sys.argv[1])], "auto")
out = {}
for name, text in replies.items():
    for finish in ("stop", "length"):
        r = tools.reply(text, finish)
        out[f"{name} {finish}"] = [r.content == text, len(r.calls), r.finish_reason]
print(json.dumps(out))
"""


def test_reading_a_pathological_reply_is_linear():
    """A watchdog, not a timing: each reply is read in microseconds to milliseconds; a
    backtracking read of the first one alone runs for many minutes."""
    try:
        done = subprocess.run([sys.executable, "-c", _READ, json.dumps(WEATHER)],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading the pathological replies ran past the 60 s watchdog")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    for name in ("spaces", "spaces_x", "tags", "nested", "long"):
        assert out[f"{name} stop"] == [True, 0, "stop"], name           # content, as is
    # cut by max_tokens inside a call (an opening tag, no closing one): no content
    assert out["spaces length"] == out["spaces_x length"] == out["tags length"] == \
        [False, 0, "length"]
    assert out["nested length"] == out["long length"] == [True, 0, "length"]


def reply(job, text, finish):
    st = ChoiceState()
    st.text, st.finish_reason = text, finish
    return final_json(job, [st], TOK, "m", "fp")["choices"][0]


def streamed(job, text, finish) -> list[dict]:
    st, base = ChoiceState(), envelope(job, "m", "fp", chunk=True)
    def out(part, last):
        return RequestOutput("r", list(part.encode()), part, last, finish if last else None,
                             Usage(3, 0, len(text)), Timings())
    outs = [out(text[:5], False), out(text[5:], True)]
    return [c["choices"][0] for o in outs
            if (c := chunk_json(job, 0, st, o, TOK, base)) is not None]


def test_a_reply_cut_inside_a_call_is_reported_as_cut_never_as_content():
    required = chat(tool_choice="required")
    named = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    auto = chat()
    cut = [(required, f"[{CALL},{CALL[:30]}", 1), (required, CALL[:40], 0),
           (named, '{"city":"Par', 0),
           (auto, f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL[:20]}", 1),
           (auto, f"<tool_call>{CALL}</tool_call><tool_", 1)]
    for job, text, complete in cut:
        r = reply(job, text, "length")
        assert r["finish_reason"] == "length" and r["message"]["content"] is None, text
        calls = r["message"].get("tool_calls", [])
        assert len(calls) == complete, text
        for c in calls:
            assert json.loads(c["function"]["arguments"]) == {"city": "Paris",
                                                              "unit": "celsius"}
        chunks = streamed(job, text, "length")
        assert chunks[-1]["finish_reason"] == "length", text
        assert not any(c["delta"].get("content") for c in chunks), text
        if job is not named:    # (a named call streams its arguments as they come)
            assert len(chunks[-1]["delta"].get("tool_calls", [])) == complete, text
    # complete replies end as tool calls; free text cut by max_tokens stays content
    r = reply(required, f"[{CALL}]", "stop")
    assert r["finish_reason"] == "tool_calls" and len(r["message"]["tool_calls"]) == 1
    r = reply(auto, "It is sunny in", "length")
    assert r["finish_reason"] == "length" and r["message"]["content"] == "It is sunny in"
    r = reply(auto, f"<tool_call>{CALL}</tool_call>", "stop")
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None


def test_auto_reply_parsing_keeps_its_rules():
    tools = parse_tools([WEATHER], "auto")
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert len(tools.reply(ok + "\n" + ok, "stop").calls) == 2
    assert len(tools.reply(ok * MAX_TOOL_CALLS, "stop").calls) == MAX_TOOL_CALLS
    too_many = ok * (MAX_TOOL_CALLS + 1)                              # more: content
    assert tools.reply(too_many, "stop").content == too_many
    for content in ("hi " + ok, ok + " bye", "<tool_call>{\"name\": \"nope\"}</tool_call>",
                    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
                    "<tool_call>not json</tool_call>", "   ", ok[:-3]):
        r = tools.reply(content, "stop")
        assert (r.content, r.calls, r.finish_reason) == (content, (), "stop"), content


def test_deeply_nested_tool_schemas_and_arguments_are_refused_or_kept_as_text():
    deep = {"type": "string"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    for choice in ("auto", "required", "none"):
        with pytest.raises(OpenAIError) as e:
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}],
                 tool_choice=choice)
        assert e.value.status == 400 and "nests deeper than 64" in e.value.message
        assert e.value.param == "tools[0].function.parameters"
    args = "[" * 100_000 + "]" * 100_000       # an earlier call's arguments, given back
    job = chat(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}])
    assert job.choices[0][0]
