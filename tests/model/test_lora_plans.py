"""Plans built with `lora`: the step takes adapters as inputs. An adapter in a slot gives the
logits of the base model with that adapter merged into its weights; a row on the base model
(slot -1) gives the base model's; a mixed batch gives each row what it gets alone; a
quantized base (W4A8) takes float adapters; a plan without lora keeps its step."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

from kiln.builder.arch.blocks import DecoderModel
from kiln.builder.build import build
from kiln.builder.compile import INPUT_NAMES
from kiln.builder.progress import Progress
from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.spec import load_spec
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.lora_buffers import AdapterWeights
from kiln.runtime.plan import load_plan
from tests.conftest import TEST_PLANS
from tests.model.test_quant_plans import tiny_spec, write_spec

pytestmark = pytest.mark.model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = {"max_rank": 16, "target_modules": list(ALL), "max_adapters_per_batch": 3,
        "max_cpu_adapters": 4}


def lora_spec(name: str, precision: dict, lora: dict) -> dict:
    return {**tiny_spec(name, precision), "lora": lora}


@pytest.fixture(scope="module")
def lora_plans(tmp_path_factory) -> dict[str, object]:
    """fp32 (every target) and W4A8 (three targets) plans, with their specs."""
    d = tmp_path_factory.mktemp("lora-specs")
    specs = {"fp32": lora_spec("tiny-lora-fp32", {"weights": "fp32"}, LORA),
             "w4a8": lora_spec("tiny-lora-w4a8", {"weights": "int4", "activations": "int8"},
                               {**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"]})}
    out = {}
    for key, data in specs.items():
        path = write_spec(d, data)
        out[key] = build(path, TEST_PLANS / data["name"], progress=Progress(enabled=False)).path
        out[key + "_spec"] = path
    return out


def random_adapter(plan, rank: int, modules, seed: int, scale: float = 0.75) -> AdapterWeights:
    """An adapter of `rank` on `modules` with random A and B, in the plan's layout."""
    lo, L = plan.manifest.lora, plan.shape.num_layers
    g = torch.Generator().manual_seed(seed)
    a = {m: torch.randn(L, rank, lo.in_features[m], generator=g) / lo.in_features[m] ** 0.5
         for m in modules}
    b = {m: torch.randn(L, lo.out_features[m], rank, generator=g) * 0.2 for m in modules}
    return AdapterWeights(f"random-{seed}", rank, scale, a, b)


# module -> (parameter of a layer, first row of the module's part of it)
def _part(model: DecoderModel, layer: int, module: str):
    cfg, blk = model.cfg, model.layers[layer]
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (blk.attention.wqkv.weight, 0), "k_proj": (blk.attention.wqkv.weight, q),
            "v_proj": (blk.attention.wqkv.weight, q + kv), "o_proj": (blk.attention.wo.weight, 0),
            "gate_proj": (blk.feed_forward.w13.weight, 0),
            "up_proj": (blk.feed_forward.w13.weight, inter),
            "down_proj": (blk.feed_forward.w2.weight, 0)}[module]


@torch.no_grad()
def merged(model: DecoderModel, adapter: AdapterWeights) -> DecoderModel:
    """A copy of the eager model with W += scale * B @ A on each module of the adapter."""
    m = copy.deepcopy(model)
    for name in adapter.a:
        for i in range(m.cfg.num_layers):
            w, row = _part(m, i, name)
            delta = adapter.scale * adapter.b[name][i] @ adapter.a[name][i]
            w[row:row + delta.shape[0]] += delta
    return m


def eager_logits(model, toks, pools_cfg) -> torch.Tensor:
    from kiln.plugins.paged_kv import kv_format

    cfg = model.cfg
    kc, vc = kv_format.new_pools("fp32", cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim)
    inp = ModelInput.build(toks, [0] * len(toks), pools_cfg, 16)
    with torch.no_grad():
        return model(*inp.args(), kc, vc)


def run(ex: Executor, toks, seq_slots, tables) -> torch.Tensor:
    inp = ModelInput.build(toks, [0] * len(toks), tables, 16)
    slots = ex.lora.token_slots(seq_slots, [len(t) for t in toks])
    return ex.execute(inp, slots)


def test_adapter_rows_equal_the_merged_model_and_base_rows_the_base(lora_plans):
    plan = load_plan(lora_plans["fp32"])
    ex = Executor.from_plan(plan)
    first = random_adapter(plan, 16, ALL, seed=1)
    second = random_adapter(plan, 8, ("q_proj", "v_proj", "down_proj"), seed=2, scale=2.0)
    ex.lora.write(0, first)
    ex.lora.write(2, second)
    model = load_model(open_checkpoint(load_spec(lora_plans["fp32_spec"]).model)).eval()
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (9, 5, 7)]
    tables = [[1], [2], [3]]
    got = run(ex, toks, [0, -1, 2], tables)
    want = torch.cat([eager_logits(merged(model, first), toks[:1], tables[:1]),
                      eager_logits(model, toks[1:2], tables[1:2]),
                      eager_logits(merged(model, second), toks[2:], tables[2:])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    base = eager_logits(model, toks[:1], tables[:1])
    assert (got[0] - base[0]).abs().max() > 0.1         # the adapter visibly changes logits


def test_mixed_batch_rows_equal_each_row_alone(lora_plans):
    plan = load_plan(lora_plans["fp32"])
    ex = Executor.from_plan(plan)
    for slot, seed in ((0, 3), (1, 4), (2, 5)):
        ex.lora.write(slot, random_adapter(plan, 4 + 4 * slot, ALL, seed))
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (6, 3, 8, 4)]
    seq_slots, tables = [2, -1, 0, 1], [[4], [5], [6], [7]]
    together = run(ex, toks, seq_slots, tables)
    for i in range(4):
        alone = run(ex, toks[i:i + 1], seq_slots[i:i + 1], tables[i:i + 1])
        torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=1e-5)


def test_quantized_base_takes_float_adapters(lora_plans):
    plan = load_plan(lora_plans["w4a8"])
    assert plan.manifest.precision.activations == "int8"
    assert plan.manifest.lora.target_modules == ("q_proj", "v_proj", "down_proj")
    ex = Executor.from_plan(plan)
    adapter = random_adapter(plan, 16, ("q_proj", "v_proj", "down_proj"), seed=6)
    ex.lora.write(1, adapter)
    zero = AdapterWeights("zero", 16, 1.0, {m: torch.zeros_like(t) for m, t in adapter.a.items()},
                          adapter.b)
    ex.lora.write(0, zero)                 # A = 0: the base model's logits exactly
    toks, tables = [[5, 9, 11, 2], [5, 9, 11, 2], [5, 9, 11, 2]], [[1], [2], [3]]
    out = run(ex, toks, [-1, 0, 1], tables)
    assert torch.equal(out[0], out[1])
    assert (out[2] - out[0]).abs().max() > 0.1


def test_a_plan_without_lora_keeps_its_step():
    params = inspect.signature(DecoderModel.forward).parameters
    names = tuple(params)[1:]
    assert names[:len(INPUT_NAMES)] == INPUT_NAMES
    assert all(params[n].default is None for n in names[len(INPUT_NAMES):])


def test_lora_refuses_expert_mlps():
    from kiln.builder.arch.families import build_model, config_from_hf

    cfg = config_from_hf({"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "num_local_experts": 4, "num_experts_per_tok": 2})
    with torch.device("meta"):
        model = build_model(cfg)
    with pytest.raises(ValueError, match="experts"):
        model.enable_lora(("q_proj", "down_proj"))
    model.enable_lora(("q_proj", "o_proj"))
    assert model.lora_targets == ("q_proj", "o_proj")
