"""Constrained decoding end to end: a real `kiln serve` of a tiny random model (whose free text
is garbage -- exactly where constraints must hold) driven by the unmodified `openai` SDK,
kiln.v1 and tritonclient. Every constrained output must parse and validate; unconstrained
requests batched with constrained ones must get exactly their solo greedy output."""
from __future__ import annotations

import asyncio
import json
import random
import re

import grpc
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
import yaml

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from tests.conftest import ROOT, TEST_PLANS
from tests.server_helpers import HttpServerProcess, copy_with_chat_template

pytestmark = pytest.mark.model

MODEL = "tiny-guided"
# SmolLM2-135M-Instruct's chat template (no tools section: tools take the generic fallback)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def guided_plan(tmp_path_factory):
    """The tiny random model with room for tool prompts (one token per byte): 2,048 tokens of
    context (tool prompts are long), 16 sequences a step, SmolLM2's chat template."""
    from kiln.builder.build import build
    from kiln.builder.progress import Progress

    spec = yaml.safe_load((ROOT / "model_specs" / "tiny-random.yaml").read_text())
    spec["name"] = MODEL
    spec["model"]["arch"]["max_position_embeddings"] = 2048
    spec["limits"] = {"max_batch_size": 16, "max_seq_len": 2048, "max_num_tokens": 256}
    spec["kv_cache"]["memory"] = "16MiB"
    tmp = tmp_path_factory.mktemp("spec")
    (tmp / "tiny-guided.yaml").write_text(yaml.safe_dump(spec))
    built = build(tmp / "tiny-guided.yaml", TEST_PLANS / MODEL,
                  progress=Progress(enabled=False)).path
    return copy_with_chat_template(built, tmp / "plan", CHATML)


@pytest.fixture(scope="module")
def server(guided_plan, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    s = HttpServerProcess(guided_plan, "--drain-seconds", "5", log_path=log)
    try:
        yield s.wait_serving()
    finally:
        assert s.terminate() == 0, s.log()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=300)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0,
                              timeout=300)


# ---- 20 generated JSON schemas ----------------------------------------------------------------
def _leaf(rng: random.Random, floats: bool) -> dict:
    kind = rng.choice(["string", "integer", "number" if floats else "integer", "boolean",
                       "enum"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None, True], rng.randint(2, 4))}


def _node(rng: random.Random, depth: int, floats: bool) -> dict:
    r = rng.random()
    if depth < 2 and r < 0.3:
        return _object(rng, depth + 1, floats)
    if depth < 2 and r < 0.5:
        return {"type": "array", "items": _node(rng, depth + 1, floats),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return _leaf(rng, floats)


def _object(rng: random.Random, depth: int, floats: bool) -> dict:
    names = rng.sample(["id", "name", "size", "tags", "owner", "flag", "score", "kind", "meta"],
                       rng.randint(1, 4))
    props = {n: _node(rng, depth, floats) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


# Every schema's language is finite (bounded strings, arrays, integers) except the digits of a
# float, which a greedy random model may repeat forever: floats only in the sampled (odd)
# requests, where the grammar's terminators get drawn.
SCHEMAS = [_object(random.Random(seed), 0, seed % 2 == 1) for seed in range(20)]


def test_20_generated_json_schemas_validate(server):
    async def one(c, i, schema):
        return await c.chat.completions.create(
            model=MODEL, max_tokens=700, temperature=0 if i % 2 == 0 else 1.0, seed=i,
            messages=[{"role": "user", "content": f"Describe item {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})

    async def main():
        async with aclient(server) as c:
            return await asyncio.gather(*(one(c, i, s) for i, s in enumerate(SCHEMAS)))

    for schema, r in zip(SCHEMAS, asyncio.run(main())):
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (schema, ch.message.content)
        jsonschema.validate(json.loads(ch.message.content), schema)
    server.wait_idle()


def test_json_object_streamed_and_completions(server):
    c = client(server)
    chunks = list(c.chat.completions.create(
        model=MODEL, max_tokens=700, temperature=0, stream=True,
        messages=[{"role": "user", "content": "an object please"}],
        response_format={"type": "json_object"}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    if finish == "stop":       # a free-form object may outrun max_tokens on random weights
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 2, "maxItems": 4}
    r = c.completions.create(model=MODEL, prompt="digits:", max_tokens=100, temperature=0,
                             extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_regex_choice_and_grammar(server):
    c = client(server)
    pattern = r"[A-Z][a-z]{2,5} [0-9]{3}-[0-9]{4}"
    for i in range(3):
        r = c.completions.create(model=MODEL, prompt=f"call {i}:", max_tokens=40,
                                 temperature=1.0, seed=i, extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    options = ["yes", "no", "maybe later"]
    r = c.chat.completions.create(model=MODEL, max_tokens=20, n=4, temperature=1.0, seed=1,
                                  messages=[{"role": "user", "content": "ok?"}],
                                  extra_body={"guided_choice": options})
    assert all(ch.message.content in options for ch in r.choices)
    grammar = 'start: "(" expr ")"\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[1-9]/'
    r = c.completions.create(model=MODEL, prompt="math:", max_tokens=60, temperature=0,
                             extra_body={"guided_grammar": grammar})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9]([+*][1-9])*\)", text), text
    else:
        assert re.fullmatch(r"\([1-9]([+*][1-9])*", text), text
    gbnf = 'root ::= "id-" [0-9] [0-9] [0-9]'
    r = c.completions.create(model=MODEL, prompt="id:", max_tokens=20, temperature=0,
                             extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"id-[0-9]{3}", r.choices[0].text)


# ---- tools ------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
         "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Current weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def _streamed_calls(chunks) -> tuple[dict, str]:
    """index -> {id, name, arguments} accumulated from tool-call deltas, as SDK users do."""
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            if d.function is not None:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    return calls, finish


def test_tool_choice_required_and_named(server):
    c = client(server)
    # parallel calls: sampled (seeded), as a greedy random model repeats its first call forever
    for parallel, temperature in ((True, 1.0), (False, 0)):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=7,
                  parallel_tool_calls=parallel, max_tokens=500, temperature=temperature)
        r = c.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        _check_calls(ch.message.tool_calls)
        assert parallel or len(ch.message.tool_calls) == 1
        streamed, finish = _streamed_calls(c.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls"
        assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]

    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                  max_tokens=200, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    streamed, finish = _streamed_calls(c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, stream=True,
        max_tokens=200, temperature=0))
    assert finish == "tool_calls" and len(streamed) == 1
    assert streamed[0]["name"] == "get_time" and streamed[0]["id"].startswith("call_")
    assert streamed[0]["arguments"] == call.function.arguments     # the same greedy reply

    # a second turn: the call and its result go back through the template's fallback
    r2 = c.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=500, temperature=0,
                                   messages=[
                                       *ASK, r.choices[0].message.model_dump(exclude_none=True),
                                       {"role": "tool", "tool_call_id": call.id,
                                        "content": '{"time": "12:00"}'}])
    assert r2.choices[0].finish_reason == "tool_calls", r2.choices[0]
    _check_calls(r2.choices[0].message.tool_calls)


# Both properties required, no additionalProperties: strict function calling allows exactly
# these two keys, once each.
LOOSE_WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}


def _weather_tool(**city) -> dict:
    params = json.loads(json.dumps(LOOSE_WEATHER))
    params["properties"]["city"].update(city)
    return {"type": "function", "function": {"name": "get_weather", "parameters": params,
                                             "description": "Get the current weather in a city"}}


def _exact_keys(calls) -> None:
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and list(args) == ["city", "unit"], args


def test_tool_calls_end_as_tool_calls_or_say_they_were_cut(server):
    c = client(server)
    ask = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
    kw = dict(model=MODEL, messages=ask, tools=[_weather_tool()], tool_choice="required",
              max_tokens=96, temperature=0)
    # One call and the array closes: the reply ends as a tool call
    ch = c.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    assert len(ch.message.tool_calls) == 1
    _exact_keys(ch.message.tool_calls)
    # Parallel calls (the SDK's default): the greedy random model starts call after call
    # until max_tokens; what it completed are calls, the cut one is dropped, never content
    for r in (c.chat.completions.create(**kw),
              c.chat.completions.create(**{**kw, "max_tokens": 30})):   # cut in the first
        ch = r.choices[0]
        assert ch.finish_reason in ("tool_calls", "length") and ch.message.content is None, ch
        _exact_keys(ch.message.tool_calls or [])
    assert ch.finish_reason == "length" and not ch.message.tool_calls
    chunks = [x.choices[0] for x in c.chat.completions.create(**kw, stream=True) if x.choices]
    assert chunks[-1].finish_reason in ("tool_calls", "length")
    assert not any(x.delta.content for x in chunks)
    # Sampled, with the city bounded so that calls complete: exactly the declared keys
    for seed in range(4):
        for parallel in (True, False):
            ch = c.chat.completions.create(
                model=MODEL, messages=ask, tools=[_weather_tool(maxLength=8)], seed=seed,
                tool_choice="required", max_tokens=400, temperature=1.0,
                parallel_tool_calls=parallel).choices[0]
            assert ch.message.content is None and (ch.finish_reason == "length" or
                                                   ch.message.tool_calls), ch
            assert parallel or len(ch.message.tool_calls) == 1
            _exact_keys(ch.message.tool_calls or [])


# ---- batching ---------------------------------------------------------------------------------
def test_unconstrained_requests_batched_with_constrained_ones_keep_their_greedy_output(server):
    c = client(server)
    prompts = [f"free text number {i} " * (i + 1) for i in range(4)]
    solo = [c.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
            .choices[0].text for p in prompts]

    async def main():
        async with aclient(server) as ac:
            free = [ac.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
                    for p in prompts]
            bound = [ac.chat.completions.create(
                model=MODEL, max_tokens=700, temperature=i % 2, seed=i,
                messages=[{"role": "user", "content": f"json {i}"}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": SCHEMAS[i]}})
                for i in range(8)]
            return await asyncio.gather(*bound[:4], *free, *bound[4:])

    out = asyncio.run(main())
    assert [r.choices[0].text for r in out[4:8]] == solo
    for i, r in enumerate(out[:4] + out[8:]):
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])


# ---- refusals and the gRPC APIs ----------------------------------------------------------------
def test_bad_constraints_are_refused_at_submission_on_every_api(server):
    c = client(server)
    bad = [dict(response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
           dict(extra_body={"guided_regex": "[0-9"}),
           dict(extra_body={"guided_grammar": "start: missing_rule"}),
           dict(extra_body={"guided_json": "{not json"}),
           dict(extra_body={"guided_regex": "a+", "min_tokens": 3}),   # the grammar ends it
           dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kw)
        assert e.value.status_code == 400, kw
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, stream=True,
                                  extra_body={"guided_regex": "(unclosed"})
    assert "regex" in e.value.message

    with server.channel() as ch:
        stub = pb_grpc.KilnStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
                guided=pb.GuidedDecoding(json_schema='{"type": "strin"}')))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "strin" in e.value.details()
    with triton.InferenceServerClient(server.url) as tc:
        with pytest.raises(triton.InferenceServerException) as e:
            tc.infer(MODEL, _kserve_inputs("x", guided_regex="[0-9"))
        assert "StatusCode.INVALID_ARGUMENT" in str(e.value.status())
    server.wait_idle()


def _kserve_inputs(prompt: str, max_tokens: int = 60, **guided) -> list:
    def tensor(name, values, dtype, tt):
        t = triton.InferInput(name, [1, len(values)], tt)
        t.set_data_from_numpy(np.array([values], dtype=dtype))
        return t
    inputs = [tensor("text_input", [prompt.encode()], object, "BYTES"),
              tensor("max_tokens", [max_tokens], np.int32, "INT32"),
              tensor("exclude_input_in_output", [True], bool, "BOOL")]
    for name, v in guided.items():
        vals = [x.encode() for x in v] if isinstance(v, list) else [v.encode()]
        inputs.append(tensor(name, vals, object, "BYTES"))
    return inputs


def test_kiln_v1_and_kserve_constraints(server):
    schema = SCHEMAS[3]
    with server.channel() as ch:
        stub = pb_grpc.KilnStub(ch)
        for g, check in (
                (pb.GuidedDecoding(json_schema=json.dumps(schema)),
                 lambda t: jsonschema.validate(json.loads(t), schema)),
                (pb.GuidedDecoding(regex=r"[a-f]{4}"),
                 lambda t: re.fullmatch(r"[a-f]{4}", t) or pytest.fail(t)),
                (pb.GuidedDecoding(choice=pb.Choices(choices=["alpha", "beta"])),
                 lambda t: t in ("alpha", "beta") or pytest.fail(t))):
            chunks = list(stub.Generate(pb.GenerateRequest(
                prompt="go", sampling=pb.SamplingParams(max_tokens=700, temperature=0,
                                                        guided=g))))
            assert chunks[-1].finish_reason == "stop"
            check("".join(x.text for x in chunks))
    with triton.InferenceServerClient(server.url) as tc:
        r = tc.infer(MODEL, _kserve_inputs("go", 700, guided_json=json.dumps(schema)))
        jsonschema.validate(json.loads(r.as_numpy("text_output")[0][0]), schema)
        r = tc.infer(MODEL, _kserve_inputs("go", 20, guided_choice=["left", "right"]))
        assert r.as_numpy("text_output")[0][0].decode() in ("left", "right")
