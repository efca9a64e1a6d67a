"""LoRA plans on quantized bases (QLoRA-style: int8, int4 and fp8 weights, float adapters).
The compiled step with an adapter gives what the same quantized model gives eagerly with that
adapter in its slot; the adapter visibly moves the logits; a row of a mixed batch gives what it
gets beside base-model rows."""
from __future__ import annotations

import pytest
import torch

from kiln.builder.build import _quantize, build
from kiln.builder.progress import Progress
from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.spec import load_spec
from kiln.plugins.paged_kv import kv_format
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import load_plan
from tests.conftest import TEST_PLANS
from tests.model.test_lora_plans import ALL, LORA, lora_spec, random_adapter
from tests.model.test_quant_plans import PRECISIONS, write_spec

pytestmark = pytest.mark.model

BASES = ("int8", "int4", "fp8")
SLOTS = {**LORA, "max_adapters_per_batch": 2}


@pytest.fixture(scope="module")
def quant_lora_plans(tmp_path_factory) -> dict[str, tuple]:
    """weights -> (plan dir, spec path): the tiny model quantized, every module adaptable."""
    d = tmp_path_factory.mktemp("lora-quant-specs")
    out = {}
    for weights in BASES:
        precision, accuracy = PRECISIONS[weights]
        data = lora_spec(f"tiny-lora-{weights}", precision, SLOTS)
        data["accuracy"].update(accuracy)
        path = write_spec(d, data)
        plan = build(path, TEST_PLANS / data["name"], progress=Progress(enabled=False)).path
        out[weights] = (plan, path)
    return out


def quantized_eager(spec_path):
    """The builder's quantized model (the same packing and kernels), eager, taking adapters."""
    spec = load_spec(spec_path)
    ckpt = open_checkpoint(spec.model)
    model = load_model(ckpt, dtype=torch.float32).eval()
    _quantize(model, spec, ckpt, Progress(enabled=False))
    model.enable_lora(spec.lora.target_modules)
    return model, spec


def step(fn, lora, toks, seq_slots, tables, pools):
    inp = ModelInput.build(toks, [0] * len(toks), tables, 16)
    slots = lora.token_slots(seq_slots, [len(t) for t in toks])
    with torch.no_grad():
        return fn(*inp.args(), *pools, *lora.args(slots))


@pytest.mark.parametrize("weights", BASES)
def test_quantized_base_with_adapter_equals_its_eager_model(quant_lora_plans, weights):
    plan_dir, spec_path = quant_lora_plans[weights]
    plan = load_plan(plan_dir)
    assert plan.manifest.precision.weights == weights
    ex = Executor.from_plan(plan)
    ex.lora.write(0, random_adapter(plan, 16, ALL, seed=11))
    ex.lora.write(1, random_adapter(plan, 8, ("q_proj", "v_proj", "down_proj"), seed=12,
                                    scale=2.0))
    model, spec = quantized_eager(spec_path)
    cfg = model.cfg
    g = torch.Generator().manual_seed(2)
    toks = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (7, 5, 6)]
    seq_slots, tables = [0, -1, 1], [[1], [2], [3]]

    def pools():
        return kv_format.new_pools(spec.kv_dtype, cfg.num_layers, 16, 16, cfg.num_kv_heads,
                                   cfg.head_dim)

    got = step(ex.step_fn, ex.lora, toks, seq_slots, tables, pools())
    want = step(model, ex.lora, toks, seq_slots, tables, pools())
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    # the same prompt on the base model and on each adapter: each adapter moves the logits
    same = [toks[0]] * 3
    rows = step(ex.step_fn, ex.lora, same, [-1, 0, 1], tables, pools())
    assert (rows[1] - rows[0]).abs().max() > 0.1
    assert (rows[2] - rows[0]).abs().max() > 0.1
    # a row of the mixed batch is what it is beside base-model rows: the same tokens, the
    # other rows' adapters removed. (The same row count: a quantized base's kernels may take
    # another path at another count, e.g. AMX tiles from 8 rows, which moves the base's own
    # logits by 1e-4 whatever the adapters.)
    for i in range(3):
        only = [s if j == i else -1 for j, s in enumerate(seq_slots)]
        beside_base = step(ex.step_fn, ex.lora, toks, only, tables, pools())
        torch.testing.assert_close(got[i:i + 1], beside_base[i:i + 1], atol=1e-5, rtol=1e-5)
