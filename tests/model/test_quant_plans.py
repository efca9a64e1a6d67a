"""Quantized and bf16 plans of a tiny random Llama: build (AOTInductor), gate, generate, verify.

The plans are built once per session into the test-plan cache (reused while their
fingerprint holds, like conftest's tiny_plan). Failing builds use the eager backend: they
stop at the gate or before compiling, and the point is that nothing is written.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from kiln.builder.build import BuildError, build
from kiln.builder.progress import Progress
from kiln.builder.spec import SpecError, parse_spec
from kiln.contracts.manifest import PlanManifest
from kiln.runtime.engine import Engine
from kiln.runtime.plan import load_plan
from kiln.runtime.sampling import SamplingParams
from tests.conftest import TEST_PLANS

pytestmark = pytest.mark.model

ARCH = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512}
PRECISIONS = {   # name -> precision section (+ accuracy extras)
    "int8": ({"weights": "int8", "keep_high_precision": []}, {}),
    "int4": ({"weights": "int4"}, {"calibration_text": "pydoc"}),     # AWQ, auto group_size
    "fp8": ({"weights": "fp8"}, {}),
    "bf16": ({"weights": "bf16"}, {}),
}


def tiny_spec(name: str, precision: dict, accuracy: dict | None = None,
              backend: str = "aoti", arch: dict | None = None) -> dict:
    return {"name": name, "model": {"source": "random", "seed": 0, "arch": arch or ARCH},
            "target": {"device": "cpu", "backend": backend}, "precision": precision,
            "limits": {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64},
            "kv_cache": {"tokens_per_block": 16, "memory": "8MiB"},
            "accuracy": {"eval_tokens": 512, **(accuracy or {})}}


def write_spec(dir: Path, data: dict) -> Path:
    path = dir / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def quant_plans(tmp_path_factory) -> dict[str, Path]:
    """name -> built plan dir, one per precision."""
    specs = tmp_path_factory.mktemp("quant-specs")
    out = {}
    for prec, (precision, accuracy) in PRECISIONS.items():
        path = write_spec(specs, tiny_spec(f"tiny-{prec}", precision, accuracy))
        out[prec] = build(path, TEST_PLANS / f"tiny-{prec}", progress=Progress(enabled=False)).path
    return out


@pytest.mark.parametrize("prec", list(PRECISIONS))
def test_plan_records_precision_and_accuracy(quant_plans, prec):
    m = json.loads((quant_plans[prec] / "plan.json").read_text())
    assert m["precision"]["weights"] == prec
    q = m["precision"]["quantization"]
    acc = m["accuracy"]
    for key in ("ppl", "ref_ppl", "ppl_increase", "max_ppl_increase", "top1_agreement",
                "tokens", "text"):
        assert key in acc, key
    assert acc["text"] == "pydoc" and acc["passed"] and acc["tokens"] == 512 - 512 // 64
    assert acc["ppl_increase"] <= acc["max_ppl_increase"]
    assert acc["max_ppl_increase"] == {"int8": 0.03, "int4": 0.15, "fp8": 0.05, "bf16": 0.01}[prec]
    assert 0.5 < acc["top1_agreement"] <= 1.0
    assert acc["reference_top1"] in m["files"]
    if prec == "bf16":   # weight-only: every weight bf16 (embedding too)
        # float32 compute, or bf16 from 8 rows where the kernels do (avx512_bf16, amx)
        in_bf16 = any("bf16 from 8 rows" in path for path in m["engine"]["kernel_paths"].values())
        assert q["embedding"] == "bf16"
        assert q["bf16_compute"] == ("bf16-from-8-rows" if in_bf16 else "upcast-fp32")
        assert q["kept"] == [] and m["kv_cache"]["dtype"] == "bf16"
    assert q["scheme"] == prec and "quant" in m["engine"]["plugins"]
    assert any(k.endswith(".so") and "quant" in k for k in m["engine"]["kernels"])
    assert m["check"]["max_logit_diff"] <= m["check"]["tolerance"]
    if prec == "int4":
        assert q["group_size"] == 64 and q["group_size_source"] == "auto"   # K in {64, 128}
        assert q["method"] == "awq" and q["awq_alpha"]
        assert q["kept"] == ["embed", "lm_head"] and q["embedding"] == "float"
    if prec == "int8":
        assert q["embedding"] == "int8-per-row" and "output" in q["quantized"]
    if prec == "fp8":
        assert q["fp8_compute"] == "upcast-fp32"


@pytest.mark.parametrize("prec", list(PRECISIONS))
def test_plan_generates(quant_plans, prec):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with Engine.from_plan(load_plan(quant_plans[prec])) as eng:
        outs = eng.generate([[5, 6, 7, 8], list(range(40, 100))], greedy)
    assert [len(o.token_ids) for o in outs] == [8, 8]


def test_rerun_gate_matches_the_build(quant_plans):
    from kiln.runtime.accuracy_gate import rerun_gate
    from kiln.runtime.tools.verify import verify_plan

    plan = load_plan(quant_plans["int8"])
    got = rerun_gate(plan)
    assert got.ok and abs(got.drift) < 1e-3
    assert got.ppl == pytest.approx(plan.manifest.accuracy.ppl, rel=1e-3)
    report = verify_plan(plan)
    assert report.ok and "accuracy: passed" in report.text


def test_inspect_shows_accuracy(quant_plans):
    from kiln.runtime.tools.inspect import describe

    m = PlanManifest.loads((quant_plans["int4"] / "plan.json").read_text())
    line = [l for l in describe(m).splitlines() if l.startswith("accuracy")][0]
    assert "unquantized" in line and "top-1 agreement" in line and "limit 15.00%" in line


def test_reference_is_cached(tmp_path, monkeypatch):
    from kiln.builder.accuracy_reference import Gate
    from kiln.builder.sources import open_checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = parse_spec(yaml.safe_dump(tiny_spec("t", {"weights": "int8"}, backend="eager")))
    ckpt = open_checkpoint(spec.model)
    g1 = Gate(spec, ckpt)
    g1.compute_reference()
    g2 = Gate(spec, ckpt)
    g2.compute_reference()
    assert not g1.ref_cached and g2.ref_cached
    assert g2.ref.top1 == g1.ref.top1 and g2.ref.ppl == pytest.approx(g1.ref.ppl)
    assert len(list((tmp_path / "cache" / "kiln" / "accuracy").glob("*.json"))) == 1


def test_gate_fails_the_build_and_writes_nothing(tmp_path):
    spec = write_spec(tmp_path, tiny_spec("tiny-int4-strict", {"weights": "int4"},
                                          {"max_ppl_increase": 0.0}, backend="eager"))
    out = tmp_path / "plans" / "tiny-int4-strict"
    with pytest.raises(BuildError, match=r"accuracy gate failed .*int4 weights.*above "
                                         r"accuracy.max_ppl_increase 0.00%.*no plan was written"):
        build(spec, out, progress=Progress(enabled=False))
    assert not out.exists()
    assert list((tmp_path / "plans").iterdir()) == []        # no temporary directory left


KV_PLANS = {   # name -> precision section: quantized KV caches, with and without quantized weights
    "kv-int8": {"weights": "int8", "kv_cache": "int8"},
    "kv-fp8": {"weights": "fp32", "kv_cache": "fp8"},
}


@pytest.fixture(scope="session")
def kv_plans(tmp_path_factory) -> dict[str, Path]:
    specs = tmp_path_factory.mktemp("kv-specs")
    return {name: build(write_spec(specs, tiny_spec(f"tiny-{name}", prec)),
                        TEST_PLANS / f"tiny-{name}", progress=Progress(enabled=False)).path
            for name, prec in KV_PLANS.items()}


@pytest.mark.parametrize("name", list(KV_PLANS))
def test_quantized_kv_plan_gates_and_records(kv_plans, name):
    m = json.loads((kv_plans[name] / "plan.json").read_text())
    kv = KV_PLANS[name]["kv_cache"]
    assert m["precision"]["kv_cache"] == kv and m["kv_cache"]["dtype"] == kv
    acc = m["accuracy"]   # gated even with fp32 weights: default = weights' + KV's share
    assert acc["passed"] and acc["max_ppl_increase"] == {"kv-int8": 0.05, "kv-fp8": 0.04}[name]
    assert m["check"]["max_logit_diff"] <= m["check"]["tolerance"]


@pytest.mark.parametrize("name", list(KV_PLANS))
def test_quantized_kv_pool_holds_more_and_batches_like_alone(kv_plans, name):
    """The pool is int8/fp8 rows with scales, sized from the same budget (so ~2x the blocks of
    a bf16 cache); greedy output of a batch equals each request alone; no block leaks."""
    from kiln.plugins.paged_kv import kv_format
    from kiln.runtime.tools.inspect import describe

    plan = load_plan(kv_plans[name])
    prompts = [[5, 6, 7, 8], list(range(40, 100)), list(range(200, 237)), [9] * 20]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Engine.from_plan(plan) as eng:
        pool = eng.executor.k_caches[0]
        assert pool.dtype == kv_format.storage_dtype(KV_PLANS[name]["kv_cache"])
        assert pool.shape[-1] == plan.shape.head_dim + 4
        per_block = eng.executor.layout.bytes_per_block     # 2 layers x 2 kv heads, D 16
        assert per_block == 16 * 2 * 2 * 2 * (16 + 4)       # K+V rows: 16 codes + a scale
        assert per_block / (16 * kv_format.bytes_per_token("bf16", 2, 2, 16)) == 20 / 32
        assert eng.executor.layout.num_blocks == (8 << 20) // per_block
        batched = [o.token_ids for o in eng.generate(prompts, greedy)]
        alone = [eng.generate([p], greedy)[0].token_ids for p in prompts]
        assert batched == alone and all(len(t) == 12 for t in batched)
        pool_ = eng.scheduler.pool
        assert pool_.num_free_blocks == pool_.num_blocks
    assert f"kv cache {KV_PLANS[name]['kv_cache']}" in describe(plan.manifest)


def test_group_size_that_does_not_divide_names_setting_and_layer(tmp_path):
    arch = dict(ARCH, hidden_size=96, intermediate_size=192, num_attention_heads=3,
                num_key_value_heads=1)    # K = 96 or 192: 64 divides neither
    spec = write_spec(tmp_path, tiny_spec("bad-group", {"weights": "int4", "group_size": 64},
                                          backend="eager", arch=arch))
    out = tmp_path / "plans" / "bad-group"
    with pytest.raises(SpecError, match=r"precision.group_size: layers.0.attention.wqkv: int4 "
                                        r"group_size 64 does not divide .*K=96"):
        build(spec, out, progress=Progress(enabled=False))
    assert not out.exists()


@pytest.mark.parametrize("precision,path,message", [
    ({"weights": "int3"}, "precision.weights", "'int3' is not allowed"),
    ({"weights": "fp16"}, "precision.weights", "not built by this version"),
    ({"weights": "int8", "group_size": 64}, "precision.group_size", "int4 weights only"),
    ({"weights": "int4", "group_size": 48}, "precision.group_size", "48"),
    ({"weights": "fp8", "activations": "fp8"}, "precision.activations",
     "fp8 activations need a GPU with FP8"),
    ({"weights": "int8", "kv_cache": "fp16"}, "precision.kv_cache", "no paged-attention kernel"),
    ({"weights": "bf16", "keep_high_precision": []}, "precision.keep_high_precision",
     "a bf16 plan stores every weight bf16"),
    ({"weights": "int8", "kv_cache": "int4"}, "precision.kv_cache", "'int4' is not allowed"),
])
def test_bad_precision_settings_are_named(precision, path, message):
    with pytest.raises(SpecError) as e:
        parse_spec(yaml.safe_dump(tiny_spec("bad", precision)))
    assert any(p == path and message in m for p, m in e.value.problems), e.value.problems


def test_calibration_text_is_int4_or_int8_activations_only():
    with pytest.raises(SpecError, match=r"accuracy.calibration_text: calibration applies to "
                                        r"int4 weights"):
        parse_spec(yaml.safe_dump(tiny_spec("bad", {"weights": "int8"},
                                            {"calibration_text": "pydoc"})))
    parse_spec(yaml.safe_dump(tiny_spec("ok", {"weights": "int8", "activations": "int8"},
                                        {"calibration_text": "pydoc"})))
    with pytest.raises(SpecError, match=r"accuracy.calibration_text: W4A8"):
        parse_spec(yaml.safe_dump(tiny_spec("bad", {"weights": "int4", "activations": "int8"},
                                            {"calibration_text": "pydoc"})))


@pytest.mark.parametrize("precision,path,message", [
    ({"weights": "fp8", "activations": "int8"}, "precision.activations",
     "need int8 or int4 weights"),
    ({"weights": "int4", "activations": "int8", "group_size": 64}, "precision.group_size",
     "use groups of 32"),
])
def test_int8_activations_need_int8_or_int4_group_32(precision, path, message):
    with pytest.raises(SpecError) as e:
        parse_spec(yaml.safe_dump(tiny_spec("bad", precision)))
    assert any(p == path and message in m for p, m in e.value.problems), e.value.problems


def _built(tmp_path, name: str, precision: dict, accuracy: dict | None = None):
    """Build (or find up to date) the tiny plan `name` with these precision/accuracy settings
    -> (plan dir, its plan.json)."""
    spec = write_spec(tmp_path, tiny_spec(name, precision, accuracy))
    plan = build(spec, TEST_PLANS / name, progress=Progress(enabled=False)).path
    return plan, json.loads((plan / "plan.json").read_text())


def _greedy_tokens(plan, n: int) -> int:
    """How many tokens the plan's engine generates for a prompt asked for n (eos ignored)."""
    with Engine.from_plan(load_plan(plan)) as eng:
        res = eng.generate(["hello world"], SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))[0]
    return len(res.token_ids)


def test_w4a8_plan_keeps_group_minimums_gates_and_generates(tmp_path):
    """int4 weights + int8 activations (W4A8): every layer linear runs kiln::linear_int4_a8 on
    the interleaved group-minimum format, the tied head W8A8 on the embedding's int8 table;
    the gate passes, the plan serves."""
    plan, m = _built(tmp_path, "tiny-w4a8", {"weights": "int4", "activations": "int8",
                                             "keep_high_precision": []})
    q = m["precision"]["quantization"]
    assert q["scheme"] == "int4_a8" and q["group_size"] == 32 and q["method"] == "rtn"
    assert q["activations"] == "int8-per-group-32-dynamic" and "int8" in q["lm_head"]
    assert m["accuracy"]["passed"]
    assert "w4a8" in next(v for k, v in m["engine"]["kernel_paths"].items() if "quant" in k)
    assert _greedy_tokens(plan, 8) == 8


def test_int4_group_32_plan_runs_the_interleaved_format_with_float_activations(tmp_path):
    """int4 weight-only at group 32 on the CPU: the linears store the interleaved format
    (int4_a8) and the compiled graph calls kiln::linear_int4_rows16 (x stays float); AWQ
    calibrates it like the [N, K/2] layout; the gate passes, the plan serves."""
    plan, m = _built(tmp_path, "tiny-int4-g32", {"weights": "int4", "group_size": 32,
                                                 "keep_high_precision": []},
                     {"calibration_text": "pydoc"})
    q = m["precision"]["quantization"]
    assert q["scheme"] == "int4_a8" and q["group_size"] == 32 and q["activations"] == "float"
    assert q["method"] == "awq" and q["awq_alpha"]
    assert m["accuracy"]["passed"]
    with zipfile.ZipFile(plan / "engine.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    calls = {op: wrapper.count(f"aoti_torch_cpu_{op}(") - 1     # less each one's declaration
             for op in ("linear_int4_rows16", "linear_int4_a8", "linear_int4")}
    assert calls == {"linear_int4_rows16": 2 * 4, "linear_int4_a8": 0, "linear_int4": 0}
    assert _greedy_tokens(plan, 8) == 8


def test_w8a8_plan_smooths_gates_and_generates(tmp_path):
    """int8 weights + int8 activations (W8A8) with SmoothQuant calibration: every linear runs
    kiln::linear_int8_a8, the gate passes, the plan serves."""
    plan, m = _built(tmp_path, "tiny-w8a8", {"weights": "int8", "activations": "int8",
                                             "keep_high_precision": []},
                     {"calibration_text": "pydoc"})
    q = m["precision"]["quantization"]
    assert m["precision"]["activations"] == "int8"
    assert q["activations"] == "int8-per-token-dynamic" and q["method"] == "smoothquant"
    assert set(q["smooth_alpha"]) == {n for n in q["quantized"]
                                      if n not in ("output", "tok_embeddings")}
    assert m["accuracy"]["passed"]
    assert "w8a8" in next(v for k, v in m["engine"]["kernel_paths"].items() if "quant" in k)
    assert _greedy_tokens(plan, 8) == 8


@pytest.mark.parametrize("name,precision,accuracy", [
    ("tiny-w4a8", {"weights": "int4", "activations": "int8", "keep_high_precision": []}, None),
    ("tiny-w8a8", {"weights": "int8", "activations": "int8", "keep_high_precision": []},
     {"calibration_text": "pydoc"}),
])
def test_activation_quantized_plans_give_a_sequence_the_same_logits_batched_and_alone(
        tmp_path, name, precision, accuracy):
    """W4A8 and W8A8 re-quantize every layer's output, so an ulp that depends on the batch
    flips activation codes and compounds over the layers (SmolLM2 W4A8: 1.9 logits). A
    sequence's logits must be bit for bit the same whatever shares its step, whichever kernel
    path its rows take (AMX tiles from 32 rows of W4A8 where the plan has them, the rest and
    smaller steps on VNNI): prefills of 10 and 40 tokens alone and beside others, and a decode
    step alone and beside 5 others."""
    from kiln.runtime.executor import Executor, KVLayout, ModelInput
    from kiln.runtime.plan import load_step_fn

    plan = load_plan(_built(tmp_path, name, precision, accuracy)[0])
    m = plan.manifest
    cfg, bs = m.model.shape, m.kv_cache.tokens_per_block
    ex = Executor(load_step_fn(plan), KVLayout(cfg.num_layers, 80, bs, cfg.num_kv_heads,
                                               cfg.head_dim, m.kv_cache.dtype))
    tables = iter([[1 + 4 * i + j for j in range(4)] for i in range(19)])   # 4 blocks each

    def logits(seqs, starts, tabs):
        return ex.execute(ModelInput.build(seqs, starts, tabs, bs))

    for first, beside in ((list(range(40, 50)), list(range(200, 230))),    # 10 + 30 rows
                          (list(range(40, 80)), list(range(200, 220)))):   # 40 + 20 rows
        mine, theirs, again = next(tables), next(tables), next(tables)
        together = logits([first, beside], [0, 0], [mine, theirs])[0]
        alone = logits([first], [0], [again])[0]
        assert torch.equal(together, alone), (len(first), len(beside))
    others = [next(tables) for _ in range(5)]
    logits([[i] for i in range(100, 105)], [0] * 5, others)
    together = logits([[7]] + [[i] for i in range(5)], [40] + [1] * 5, [mine] + others)[0]
    alone = logits([[7]], [40], [again])[0]
    assert torch.equal(together, alone), "decode"


def test_fp32_plans_skip_the_gate_unless_asked():
    spec = parse_spec(yaml.safe_dump(tiny_spec("a", {"weights": "fp32"})))
    assert spec.max_ppl_increase is None
    spec = parse_spec(yaml.safe_dump(tiny_spec("a", {"weights": "fp32"},
                                               {"max_ppl_increase": 0.001})))
    assert spec.max_ppl_increase == 0.001
