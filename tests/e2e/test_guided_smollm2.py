"""Structured output on the real SmolLM2 plan: its own chat template (no tools section: the
generic fallback), JSON schemas and tool calls that validate, through the OpenAI request
parser and the in-process engine."""
from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.runtime.engine import Engine
from kiln.runtime.server.openai_protocol import ChoiceState, final_json, parse_chat

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def engine(smollm2_plan):
    e = Engine.from_plan(smollm2_plan)
    yield e
    e.shutdown()


def reply(engine, body) -> dict:
    job = parse_chat({"model": "m", "temperature": 0, **body}, engine.tokenizer,
                     engine.config.max_seq_len)
    (ids, params), = job.choices
    res = engine.generate([ids], [params])[0]
    st = ChoiceState()
    st.text, st.finish_reason = res.text, res.finish_reason
    return final_json(job, [st], engine.tokenizer, "m", "fp")["choices"][0]


def test_json_schema_and_tool_calls_on_smollm2(engine):
    r = reply(engine, {"max_tokens": 200, "messages": [
        {"role": "user", "content": "Invent a person living in Paris. Answer in JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": PERSON}}})
    assert r["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["message"]["content"]), PERSON)

    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = reply(engine, {"max_tokens": 200, "messages": ask, "tools": [WEATHER],
                           "tool_choice": choice, "parallel_tool_calls": False})
        assert r["finish_reason"] == "tool_calls", r
        (call,) = r["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        print(choice, args)


def test_the_weather_tool_call_ends_as_one_call_with_the_declared_keys(engine):
    """tool_choice required, parameters without additionalProperties, 96 tokens: the call
    has exactly its two keys and closes; more calls only as parallel calls, complete ones."""
    params = {k: v for k, v in WEATHER["function"]["parameters"].items()
              if k != "additionalProperties"}
    params["properties"] = {"city": {"type": "string"},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}
    tool = {"type": "function", "function": {**WEATHER["function"], "parameters": params}}
    ask = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = reply(engine, {"max_tokens": 96, "messages": ask, "tools": [tool],
                           "tool_choice": "required", **extra})
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None, r
        calls = r["message"]["tool_calls"]
        assert parallel is None or len(calls) == 1
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            assert list(args) == ["city", "unit"], args
