"""`kiln serve --http-port`: the OpenAI-compatible HTTP API, end to end with the unmodified
`openai` SDK against a real server subprocess of the tiny plan (given a chat template), checked
against the native kiln.v1 gRPC API of the same process."""
from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import time
import urllib.request

import httpx
import openai
import pytest

from kiln.runtime.tools.client import stream_generate
from tests.server_helpers import HttpServerProcess, copy_with_chat_template

pytestmark = pytest.mark.model

MODEL = "tiny-random"
TOKEN = "s3cret"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_plan(tiny_plan, tmp_path_factory):
    """A copy of the tiny plan whose generation.json has a chat template (manifest updated)."""
    return copy_with_chat_template(tiny_plan, tmp_path_factory.mktemp("plan") / "tiny-chat",
                                   TEMPLATE)


class HttpServer(HttpServerProcess):
    def client(self, key=TOKEN, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, **kw)

    def aclient(self, key=TOKEN, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, **kw)

    def _metrics_text(self) -> str:   # /metrics on the API port needs the API's token
        req = urllib.request.Request(self.base + "/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        return urllib.request.urlopen(req, timeout=5).read().decode()

    def http_metrics(self) -> dict[str, float]:
        text = self._metrics_text()
        return {n: float(v) for n, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                         if ln.startswith("kiln_") and "{" not in ln)}

    def labelled(self, name: str, label: str) -> float:
        text = self._metrics_text()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(name + "{") and label in ln)


@pytest.fixture(scope="module")
def server(chat_plan, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    s = HttpServer(chat_plan, "--auth-token", TOKEN, "--drain-seconds", "5", log_path=log)
    try:
        yield s.wait_serving()
    finally:   # test_draining_is_503_last stops it and checks its exit code (0, or 3)
        stopped = s.proc.poll() is not None
        assert s.terminate() == 0 or stopped, s.log()


def native(server, prompt, max_tokens, chat=False) -> str:
    return "".join(stream_generate(server.url, prompt, max_tokens, chat=chat, token=TOKEN))


# ---- the same greedy text as kiln.v1 ---------------------------------------------------------
def test_completions_match_native_grpc(server):
    c = server.client()
    prompt = "the quick brown fox"
    want = native(server, prompt, 24)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.system_fingerprint.startswith("fp_")

    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_matches_native_grpc_and_counts_cached_tokens(server):
    c = server.client()
    msgs = [{"role": "system", "content": "you are terse " * 8},
            {"role": "user", "content": "name three colours"}]
    want = native(server, "name three colours", 20, chat=True)   # one user message
    r = c.chat.completions.create(model=MODEL, max_completion_tokens=20, temperature=0,
                                  messages=[{"role": "user", "content": "name three colours"}])
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion"

    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 48
    # the prompt's full blocks (16 tokens each) come from the prefix cache the second time
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((again.usage.prompt_tokens - 1) // 16) - 16 and cached > 0

    stream = c.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, stream=True,
                                       messages=[{"role": "user", "content": "name three "
                                                  "colours"}],
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_n_choices_stop_seed_penalties_logprobs(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="hello there", max_tokens=12, n=3,
                             temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5,
                             frequency_penalty=0.3, user="u1")
    again = c.completions.create(model=MODEL, prompt="hello there", max_tokens=12, n=3,
                                 temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5,
                                 frequency_penalty=0.3)
    assert [x.index for x in r.choices] == [0, 1, 2]
    assert [x.text for x in r.choices] == [x.text for x in again.choices]   # seeded
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == again.usage.prompt_tokens   # counted once, not n times

    greedy = c.completions.create(model=MODEL, prompt="hello there", max_tokens=16,
                                  temperature=0).choices[0].text
    stop = greedy[len(greedy) // 2:][:3]
    assert stop.strip()
    cut = c.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0,
                               stop=[stop, "\x00never"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy[:greedy.index(stop)]

    lp = c.completions.create(model=MODEL, prompt="hello there", max_tokens=6, temperature=0,
                              logprobs=3).choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-5)

    ch = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                   n=2)
    for choice in ch.choices:
        content = choice.logprobs.content
        assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
        assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
                   for t in content)
    assert ch.choices[0].message.content == ch.choices[1].message.content   # greedy


def test_models_health_metrics(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).owned_by == "kiln"
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    m = server.http_metrics()
    assert m["kiln_ready"] == 1 and m["kiln_kv_blocks_total"] > 0
    assert m["kiln_kv_blocks_total"] == server.metrics()["kiln_kv_blocks_total"]


# ---- errors, as the SDK's exceptions ----------------------------------------------------------
def test_errors_in_openai_format(server):
    c = server.client()
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")

    refused = [dict(functions=[{"name": "f", "parameters": {}}]),
               dict(logit_bias={"5": 10}),
               dict(modalities=["text", "audio"])]
    for kw in refused:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, **kw)
        (name,) = kw
        assert e.value.param == name and name in e.value.message, e.value.body
        assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:   # unknown fields are named too
        c.chat.completions.create(model=MODEL, messages=hi, max_tokens=2,
                                  extra_body={"frobnicate": 1})
    assert e.value.param == "frobnicate" and "frobnicate" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.param == "messages[0].content[0]"
    for kw, param in ((dict(temperature=7), "temperature"), (dict(max_tokens=0), "max_tokens"),
                      (dict(max_tokens=100000), None), (dict(n=0), "n")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", **{"max_tokens": 2, **kw})
        assert e.value.param == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True)
    assert e.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as e:   # drafts asked of a plan without them
        c.completions.create(model=MODEL, prompt="x", max_tokens=2,
                             extra_body={"max_draft_tokens": 2})
    assert "max_draft_tokens=2: this engine does not speculate" in e.value.message
    r = httpx.post(server.base + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(server.base + "/v1/nothing").json()["error"]["message"]


def test_32_streaming_chats_a_quarter_closed_early_free_all_blocks(server):
    """Streams closed by their client are cancelled and free their blocks (KV metrics). Half
    of the 8 leave after their first token, half as soon as the response has started. A stream
    the engine finished before its client left is counted by its finish reason, not as
    cancelled (CI saw all 8 late leavers finish first): each round checks that every request
    is counted once, and rounds repeat until a close lands while the engine generates."""
    async def one(c, i):
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"story {i} " * (i % 3 + 1)}],
            max_tokens=200 if i % 4 == 0 else 120, temperature=0.7, seed=i, stream=True,
            extra_body={"ignore_eos": True})
        if i % 8 == 4:
            await stream.close()          # headers received: the request is in the engine
            return "closed"
        got = 0
        async for ch in stream:
            got += bool(ch.choices and ch.choices[0].delta.content)
            if i % 4 == 0 and got >= 1:
                await stream.close()      # the client goes away mid-stream
                return "closed"
        return ch.choices[0].finish_reason

    async def main():
        async with server.aclient(http_client=openai.DefaultAsyncHttpxClient(
                limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    def counts():
        return {k: server.labelled("kiln_requests_total", f'outcome="{k}"')
                for k in ("cancelled", "length")}

    for _ in range(3):
        before = counts()
        results = asyncio.run(main())
        assert results.count("closed") == 8 and results.count("length") == 24, results
        assert server.wait_idle()["kiln_queue_length"] == 0
        after = counts()
        cancelled = after["cancelled"] - before["cancelled"]
        assert cancelled + after["length"] - before["length"] == 32, (before, after)
        if cancelled:
            break
    else:
        raise AssertionError("no stream closed by its client was cancelled in 3 rounds")


def test_non_streamed_request_of_a_gone_client_is_cancelled(server):
    """A client that leaves while its whole (non-streamed) completion is generating has its
    engine requests cancelled. It leaves once the server has the 8 choices in flight (a fixed
    client timeout raced the generation: a fast machine answered first). An attempt that was
    answered before the client saw them in flight is repeated."""
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 240, "n": 8,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    for _ in range(5):
        cancelled = server.labelled("kiln_requests_total", 'outcome="cancelled"')
        with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 10
            while not (answered := bool(select.select([sock], [], [], 0)[0])):
                if server.metrics().get("kiln_requests_in_flight", 0) >= 8:
                    break
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.005)
        server.wait_idle()                 # the socket is closed: the client has gone
        if not answered:
            break
    else:
        pytest.fail("every attempt was answered before its client could leave")
    assert server.labelled("kiln_requests_total", 'outcome="cancelled"') >= cancelled + 8


# ---- loading and a full queue (503, 429); draining (503) ---------------------------------------
# `kiln serve` whose plan loading waits for a file to appear: the test decides when loading
# ends (a real load takes about a second, which a request sent just after a 503 could outlast)
GATED_SERVE = """
import os, sys, time
import kiln.runtime.server.app as app
real = app._load
def _load(cfg):
    while not os.path.exists(GATE):
        time.sleep(0.02)
    return real(cfg)
app._load = _load
from kiln.cli import main
sys.argv = ["kiln", *sys.argv[1:]]
main()
"""


def test_loading_is_503_and_full_queue_is_429(chat_plan, tmp_path):
    # 503 while the plan loads; then a full queue (one running, one waiting) refuses at once
    gate = tmp_path / "loaded"
    s = HttpServer(chat_plan, "--max-batch-size", "1", "--max-queue", "1",
                   log_path=tmp_path / "serve.log",
                   entry=("-c", f"GATE = {str(gate)!r}\n" + GATED_SERVE))
    try:   # the HTTP API answers while the plan loads
        deadline = time.monotonic() + 60
        while True:
            try:
                loading = httpx.get(s.base + "/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and s.proc.poll() is None, s.log()
                time.sleep(0.02)
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:
            s.client().completions.create(model=MODEL, prompt="early", max_tokens=2)
        assert e.value.status_code == 503
        gate.touch()
        s.wait_serving()

        async def one(c, i):
            t0 = time.monotonic()
            try:
                r = await c.completions.create(model=MODEL, prompt=f"r{i}", max_tokens=250,
                                               temperature=0, extra_body={"ignore_eos": True})
                return r.choices[0].finish_reason, time.monotonic() - t0
            except openai.RateLimitError as e:
                assert e.status_code == 429 and e.code == "queue_full", e.body
                return "429", time.monotonic() - t0

        async def flood():
            async with s.aclient() as c:
                return await asyncio.gather(*(one(c, i) for i in range(8)))

        results = asyncio.run(flood())
        # one runs, one waits, the rest are refused; how many get in depends on when the
        # first leaves the waiting queue. The refused are answered at once, not after waiting.
        full = [t for r, t in results if r == "429"]
        done = [t for r, t in results if r == "length"]
        assert full and len(done) >= 1 and len(full) + len(done) == 8, results
        assert max(full) < min(done), results
    finally:
        assert s.terminate() == 0, s.log()


def test_draining_is_503_last(server):
    """SIGTERM: new requests get 503 while the accepted ones finish; exit 0, or 3 when the
    drain time ran out and requests were cancelled. Runs last: it stops the module's
    server."""
    async def one(c, i):
        # whole completions, not streams: 128 streams of tiny-model tokens kept this client's
        # loop so busy that the late request went out after the drain had ended
        try:
            r = await c.completions.create(model=MODEL, prompt=f"drain {i}", max_tokens=200,
                                           temperature=0, extra_body={"ignore_eos": True})
        except openai.InternalServerError as e:   # 503: refused after the SIGTERM (a request
            assert e.status_code == 503             # still in the client when it came: code
            return e.code                           # "unavailable"), or "cancelled" when the
                                                    # drain time is up
        return r.choices[0].finish_reason

    async def main():
        async with server.aclient(http_client=openai.DefaultAsyncHttpxClient(
                limits=httpx.Limits(max_connections=128))) as c:
            # 128 requests, 8 at a time: seconds of work, enough to see the drain from outside
            tasks = [asyncio.ensure_future(one(c, i)) for i in range(128)]
            async with httpx.AsyncClient() as h:
                deadline = time.monotonic() + 10
                while server.http_metrics()["kiln_requests_in_flight"] < 96:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.002)
                server.proc.send_signal(signal.SIGTERM)
                while (health := await h.get(server.base + "/health")).status_code == 200:
                    await asyncio.sleep(0.002)
            assert health.status_code == 503
            with pytest.raises(openai.InternalServerError) as e:
                await c.chat.completions.create(model=MODEL, max_tokens=2,
                                                messages=[{"role": "user", "content": "late"}])
            assert e.value.status_code == 503 and "shutting down" in e.value.message
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert set(results) <= {"length", "cancelled", "unavailable"} and "length" in results, results
    code = 3 if "cancelled" in results else 0
    assert server.proc.wait(30) == code, (server.proc.returncode, server.log())
