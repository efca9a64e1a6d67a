"""ModelInput.build: the decode packing (one token per sequence) gives exactly the tensors of
the general packing; ModelInput's fields are the one declaration of the engine-step inputs."""
import inspect

import pytest
import torch

from kiln.builder.arch.llama import LlamaModel
from kiln.builder.compile import INPUT_NAMES, input_names
from kiln.runtime.executor import STEP_INPUTS, ModelInput

pytestmark = pytest.mark.unit
FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
          "query_start_loc", "logits_indices")


@pytest.mark.parametrize("starts", [[0], [15], [16, 3, 40], [7, 0, 31, 63]])
def test_decode_packing_matches_the_general_packing(starts):
    B = len(starts)
    toks = [[100 + i] for i in range(B)]
    tables = [[9 + 4 * i + j for j in range(s // 16 + 1)] for i, s in enumerate(starts)]
    fast = ModelInput.build(toks, starts, tables, 16)
    general = ModelInput.build(toks, starts, tables, 16, logits_indices=list(range(B)))
    for f in FIELDS:
        a, b = getattr(fast, f), getattr(general, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
    assert fast.slot_mapping.tolist() == [t[s // 16] * 16 + s % 16
                                          for t, s in zip(tables, starts)]


def test_mixed_prefill_and_decode_packing():
    m = ModelInput.build([[1, 2, 3], [4]], [0, 5], [[7], [8, 9]], 4)
    assert m.input_ids.tolist() == [1, 2, 3, 4]
    assert m.positions.tolist() == [0, 1, 2, 5]
    assert m.slot_mapping.tolist() == [28, 29, 30, 37]
    assert m.query_start_loc.tolist() == [0, 3, 4]
    assert m.context_lens.tolist() == [3, 6]
    assert m.logits_indices.tolist() == [2, 3]


def test_the_step_inputs_are_declared_once_and_every_user_reads_that_declaration():
    assert tuple(s.name for s in STEP_INPUTS) == FIELDS
    # the export's input names and the model's forward() follow the same order
    assert INPUT_NAMES == FIELDS + ("k_caches", "v_caches")
    # (then a LoRA plan's adapters, last and optional: a plan without lora is called as before)
    assert tuple(inspect.signature(LlamaModel.forward).parameters)[1:] == input_names(True)
    assert input_names(False) == INPUT_NAMES
    # both packings produce the declared dtypes and ranks, in args() order
    for m in (ModelInput.build([[1, 2, 3], [4]], [0, 5], [[7], [8, 9]], 4),
              ModelInput.build([[1], [4]], [2, 5], [[7], [8, 9]], 4)):
        for spec, t in zip(STEP_INPUTS, m.args(), strict=True):
            assert t.dtype == spec.dtype and t.dim() == len(spec.dims), spec.name
