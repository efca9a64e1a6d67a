"""`kiln serve PLAN --lora NAME=DIR`: the OpenAI API serves each adapter as a model of its
own (listed in /v1/models with the plan's model as parent, selected by the request's
`model`), an unknown model is a 404, never the base model; with --allow-lora-loading adapters
load and unload over HTTP (a bad one refused, the server serving on); --lora on a plan built
without lora is refused before anything binds."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from kiln.runtime.engine import Engine
from kiln.runtime.plan import load_plan
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.server.app import ServeConfig, ServeError, check_config
from tests.model.test_lora_peft import PROMPTS, setup  # noqa: F401  (the plan and adapters)
from tests.server_helpers import HttpServerProcess

pytestmark = pytest.mark.model
MODEL = "tiny-lora-peft"


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):  # noqa: F811
    plan, _, dirs, _ = setup
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [a for name in ("qv8", "mlp16") for a in ("--lora", f"{name}={dirs[name]}")]
    s = HttpServerProcess(plan, *args, "--allow-lora-loading", "--drain-seconds", "5",
                          log_path=log)
    try:
        yield s.wait_serving()
    finally:
        assert s.terminate() == 0, s.log()


def _complete(server, model: str) -> httpx.Response:
    return httpx.post(server.base + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0})


def test_adapters_are_models_of_their_own(server, setup):  # noqa: F811
    cards = httpx.get(server.base + "/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [
        (MODEL, None), ("mlp16", MODEL), ("qv8", MODEL)]
    texts = {m: _complete(server, m).json()["choices"][0]["text"] for m in (MODEL, "qv8")}
    assert texts[MODEL] != texts["qv8"]
    with Engine.from_plan(load_plan(setup[0])) as eng:
        eng.adapters.load("qv8", setup[2]["qv8"])
        want = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0,
                                                         adapter="qv8"))[0]
    assert texts["qv8"] == want.text
    assert _complete(server, "qv8").json()["model"] == "qv8"
    m = server.metrics()
    assert m["kiln_lora_adapters_loaded"] == 2 and m["kiln_lora_adapters_active"] == 0
    assert m['kiln_lora_requests_total{adapter="qv8"}'] == 2
    info = [k for k in m if k.startswith("kiln_lora_requests_info{")]   # nothing in flight
    assert info == ['kiln_lora_requests_info{max_lora="2",running_lora_adapters="",'
                    'waiting_lora_adapters=""}'], info


def test_kserve_lora_name_selects_the_adapter(server):
    import tritonclient.grpc as tc

    from tests.model.test_server import text_of, triton_inputs

    def infer(lora: str | None):
        ins = triton_inputs("abc", 10)
        if lora is not None:
            t = tc.InferInput("lora_name", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[lora.encode()]], dtype=object))
            ins.append(t)
        return text_of(tc.InferenceServerClient(server.url).infer(MODEL, ins))

    index = tc.InferenceServerClient(server.url).get_model_repository_index().models
    assert [(m.name, m.state) for m in index] == [(MODEL, "READY"), ("mlp16", "READY"),
                                                  ("qv8", "READY")]
    openai = httpx.post(server.base + "/v1/completions", timeout=60, json={
        "model": "mlp16", "prompt": "abc", "max_tokens": 10, "temperature": 0})
    assert infer("mlp16") == openai.json()["choices"][0]["text"] != infer(None)
    with pytest.raises(tc.InferenceServerException, match="NOT_FOUND.*unknown adapter 'nope'"):
        infer("nope")


def test_kiln_v1_adapter_field_selects_the_adapter(server):
    import grpc

    from kiln.runtime.server.proto import kiln_pb2 as pb, kiln_pb2_grpc as pb_grpc

    def text(adapter=None):
        sp = pb.SamplingParams(max_tokens=10, temperature=0, adapter=adapter)
        with grpc.insecure_channel(server.url) as ch:
            chunks = pb_grpc.KilnStub(ch).Generate(pb.GenerateRequest(prompt="abc",
                                                                      sampling=sp))
            return "".join(c.text for c in chunks)

    openai = httpx.post(server.base + "/v1/completions", timeout=60, json={
        "model": "qv8", "prompt": "abc", "max_tokens": 10, "temperature": 0})
    assert text("qv8") == openai.json()["choices"][0]["text"] != text()
    with pytest.raises(grpc.RpcError) as e:
        text("nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_unknown_model_is_a_404_never_the_base(server):
    r = _complete(server, "all4")             # made, but not loaded
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'qv8'" in r.json()["error"]["message"]


def test_adapters_load_and_unload_at_run_time(server, setup, tmp_path):  # noqa: F811
    post = lambda route, **body: httpx.post(f"{server.base}/v1/{route}", json=body,  # noqa
                                            timeout=60)
    r = post("load_lora_adapter", lora_name="all4", lora_path=str(setup[2]["all4"]))
    assert r.status_code == 200, r.text
    assert _complete(server, "all4").status_code == 200
    (tmp_path / "empty").mkdir()
    r = post("load_lora_adapter", lora_name="bad", lora_path=str(tmp_path / "empty"))
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    r = post("load_lora_adapter", lora_name="qv8", lora_path=str(setup[2]["all4"]))
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert post("unload_lora_adapter", lora_name="all4").status_code == 200
    assert _complete(server, "all4").status_code == 404
    assert post("unload_lora_adapter", lora_name="all4").status_code == 404
    assert _complete(server, "qv8").status_code == 200          # still serving


def test_lora_on_a_plan_built_without_lora_is_refused(tiny_plan, setup):  # noqa: F811
    cfg = ServeConfig(plan=tiny_plan, loras=(("qv8", setup[2]["qv8"]),))
    with pytest.raises(ServeError, match="built without a lora section"):
        check_config(cfg)
    with pytest.raises(ServeError, match="--allow-lora-loading needs --http-port"):
        check_config(ServeConfig(plan=setup[0], lora_loading=True))
    cfg = ServeConfig(plan=setup[0], loras=(("qv8", setup[2]["qv8"]),
                                            ("qv8", setup[2]["mlp16"])))
    with pytest.raises(ServeError, match="--lora qv8: each adapter needs a name of its own"):
        check_config(cfg)
