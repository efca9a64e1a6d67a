"""`source: random` for every family: `arch.model_type` picks the family and `arch.config`
adds its other config.json keys; the model is drawn in that family's parameter order and
runs."""
from __future__ import annotations

import pytest
import torch

from kiln.builder.arch.families import param_shapes
from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.spec import ModelSpec, RandomArch
from tests.helpers import greedy_generate

pytestmark = pytest.mark.model

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen3": ("qwen3", dict(use_sliding_window=False), "layers.0.attention.q_norm.weight"),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), None),
    "gemma3_text": ("gemma3_text", dict(sliding_window=16), "layers.0.post_ffn_norm.weight"),
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_random_checkpoint_of_a_family(case):
    mtype, extra, marker = FAMILIES[case]
    arch = RandomArch(**BASE, model_type=mtype, config=extra)
    ckpt = open_checkpoint(ModelSpec(source="random", arch=arch, seed=0))
    assert ckpt.config.family == mtype
    plain = open_checkpoint(ModelSpec(source="random", arch=RandomArch(**BASE), seed=0))
    assert ckpt.weights_digest != plain.weights_digest       # the family is part of the key
    names = dict(ckpt.tensors())
    assert set(names) == set(param_shapes(ckpt.config)) != set(dict(plain.tensors()))
    if marker:
        assert marker in names
    out = greedy_generate(load_model(ckpt), [[5, 6, 7, 8]], 4)
    assert len(out.tokens[0]) == 4
    again = greedy_generate(load_model(open_checkpoint(
        ModelSpec(source="random", arch=arch, seed=0))), [[5, 6, 7, 8]], 4)
    assert again.tokens == out.tokens and torch.equal(again.prefill_logits[0],
                                                      out.prefill_logits[0])


def test_random_unknown_family_and_clashing_keys_are_refused():
    from kiln.builder.sources.base import CheckpointError
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        open_checkpoint(ModelSpec(source="random", arch=RandomArch(**BASE, model_type="gpt2")))
    with pytest.raises(ValueError, match="arch.config repeats the arch field.*hidden_size"):
        RandomArch(**BASE, config={"hidden_size": 32})
