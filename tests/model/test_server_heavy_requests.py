"""`kiln serve` under requests that cost the server much CPU (a real server subprocess on the
tiny plan): a prompt of the largest allowed size, a KServe tensor of millions of elements, a
whole response of a million logprob entries. Each is answered while health (gRPC and HTTP)
keeps answering: the work runs where it cannot stall the event loop. And requests that a chat
template or the tokenizer refuses are invalid requests (400 / INVALID_ARGUMENT), never
server errors."""
from __future__ import annotations

import struct

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from tests.model.test_server_hardening import AUTH, HEADERS, MODEL, HealthProbe, Server, kreq
from tests.server_helpers import copy_with_chat_template

pytestmark = pytest.mark.model

MAX_REQUEST = 80 * 2**20            # room for a 64 MiB KServe tensor
PROMPT_BYTES = 4 * 2**20         # a prompt of seconds of tokenizer work
LOGPROB_ENTRIES = 325_000       # 64 x 240 x 21 fit; 64 x 245 x 21 do not
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('this model takes no system message') }}{% endif %}"
            "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
HEALTH_BOUND_S = 2.0    # a stalled loop misses it by seconds; a loaded 2-core host stays under


class Probe(HealthProbe):
    """HealthProbe, and a check that fails or passes its deadline (10 s) counts as failed
    (rather than ending the probe's thread unseen)."""

    def _run(self):
        try:
            super()._run()
        except Exception:
            self.times.append((float("inf"), False))


@pytest.fixture(scope="module")
def server(tiny_plan, tmp_path_factory):
    plan = copy_with_chat_template(tiny_plan, tmp_path_factory.mktemp("plan") / "tiny-chat",
                                   TEMPLATE)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    s = Server(plan, "--max-request-bytes", str(MAX_REQUEST), "--max-prompt-bytes",
               str(PROMPT_BYTES), "--max-logprob-entries", str(LOGPROB_ENTRIES), log_path=log)
    try:
        yield s.wait_serving()
    finally:
        assert s.terminate() == 0, s.log()


def _health_held(probe: Probe, what: str) -> None:
    times = [t for t, _ in probe.times]
    print(f"health during {what}: {len(times)} checks, max {max(times) * 1e3:.0f} ms")
    assert len(times) >= 3 and all(ok for _, ok in probe.times)
    assert max(times) < HEALTH_BOUND_S, f"health took {max(times):.1f} s during {what}"


def test_largest_prompt_is_tokenized_without_stalling_health(server):
    """A prompt of the whole byte cap (4 MiB, millions of tokens: seconds of tokenizer work)
    is refused for its token count, and health answers while it is tokenized."""
    with Probe(server) as probe:
        r = httpx.post(server.base + "/v1/completions", headers=HEADERS, timeout=120,
                       json={"model": MODEL, "prompt": "hello world " * (PROMPT_BYTES // 12),
                             "max_tokens": 1})
        assert r.status_code == 400 and "max_input_len" in r.json()["error"]["message"], \
            r.text[:500]
    _health_held(probe, "a 4 MiB prompt")
    server.wait_idle()


def test_kserve_tensor_of_millions_of_elements_is_refused_undecoded(server):
    """16M empty BYTES elements (64 MiB) under a name the model does not have: refused by
    its name before any element is decoded, health answering meanwhile."""
    r = kreq("junk", "hi", 2)
    r.inputs.add(name="junk", datatype="BYTES", shape=[1, 16 * 2**20])
    r.raw_input_contents.append(struct.pack("<I", 0) * (16 * 2**20))
    with Probe(server) as probe, server.channel() as ch:
        k = kpb_grpc.GRPCInferenceServiceStub(ch)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                k.ModelInfer(r, metadata=AUTH, timeout=120)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown input 'junk'" in e.value.details()
        ok = k.ModelInfer(kreq("ok", "hi", 2), metadata=AUTH, timeout=60)
        assert ok.id == "ok"
    _health_held(probe, "64 MiB KServe tensors")


def test_logprobs_of_a_whole_response_are_made_off_the_loop(server):
    """64 choices x 240 tokens x (1 + 20 alternatives), chat format (each with its bytes):
    the whole response's token texts and JSON are made while health answers; over the cap,
    refused before generating."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 64,
            "max_tokens": 240, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
            "temperature": 1.0, "seed": 1}
    with Probe(server) as probe:
        r = httpx.post(server.base + "/v1/chat/completions", headers=HEADERS, timeout=300,
                       json=body)
        assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert len(choices) == 64
    assert all(len(c["logprobs"]["content"]) == 240 for c in choices)
    assert all(len(e["top_logprobs"]) == 20 for e in choices[0]["logprobs"]["content"])
    _health_held(probe, "a 320k-entry logprobs response")
    r = httpx.post(server.base + "/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={**body, "max_tokens": 245})
    assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", \
        r.text[:500]
    server.wait_idle()


def test_template_refusals_and_lone_surrogates_are_invalid_requests(server):
    system = [pb.ChatMessage(role="system", content="be brief"),
              pb.ChatMessage(role="user", content="hi")]
    with server.channel() as ch:
        native = pb_grpc.KilnStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(native.Generate(pb.GenerateRequest(chat=pb.Chat(messages=system),
                                                    sampling=pb.SamplingParams(max_tokens=2)),
                                 metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "takes no system message" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            native.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=system)), metadata=AUTH,
                            timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = native.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=system[1:])),
                             metadata=AUTH, timeout=60)
        assert ok.token_ids
    with httpx.Client(headers={**HEADERS, "Content-Type": "application/json"},
                      timeout=60) as http:
        r = http.post(server.base + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
        assert r.status_code == 400 and "takes no system message" in r.text, r.text
        for prompt in ('"ok \\ud800"', '["fine", "\\udfff"]'):
            r = http.post(server.base + "/v1/completions", content=(
                f'{{"model": "{MODEL}", "prompt": {prompt}, "max_tokens": 2}}'))
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        r = http.post(server.base + "/v1/chat/completions", content=(
            f'{{"model": "{MODEL}", "max_tokens": 2, '
            '"messages": [{"role": "user", "content": "\\ud83d"}]}'))
        assert r.status_code == 400 and "surrogate" in r.text, r.text
    server.wait_idle()
