"""Phi-3 / Phi-4 config reading: LongRoPE as transformers computes it, the plan's choice of
its factor set, partial rotary, the fused weight table, and the refusals."""
import copy
import json
import math

import pytest
import torch

from kiln.builder.arch.blocks import apply_rope, param_shapes, rope_inv_freq
from kiln.builder.arch.config import DecoderConfig, UnsupportedConfig
from kiln.builder.arch.families import config_from_hf, plan_mapping
from kiln.builder.arch.weights import MappingError

pytestmark = pytest.mark.unit

SHORT = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
LONG = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
PHI4_MINI = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 1024,
             "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75,
             "rope_theta": 10000.0, "tie_word_embeddings": True, "sliding_window": 1024,
             "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}


def test_longrope_is_read_as_transformers_computes_it():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config_from_hf(PHI4_MINI)
    assert cfg.family == "phi3" and cfg.rotary_dim == 12 and cfg.sliding_window == 1024
    lr = cfg.longrope
    assert lr.short_factor == tuple(SHORT) and lr.original_max_position_embeddings == 64
    kw = copy.deepcopy({k: v for k, v in PHI4_MINI.items() if k != "model_type"})
    hf = transformers.Phi3Config(**kw)   # (it rewrites its rope_scaling dict)
    fn = ROPE_INIT_FUNCTIONS["longrope"]
    short, att = fn(hf, None)
    long, _ = fn(hf, None, seq_len=65)
    assert lr.attention_factor == pytest.approx(att) == math.sqrt(1 + math.log(16) / math.log(64))
    # the plan's choice: short factors up to original_max_position_embeddings, long past it
    assert torch.allclose(rope_inv_freq(cfg.for_max_seq_len(64)), short, rtol=1e-6)
    assert torch.allclose(rope_inv_freq(cfg.for_max_seq_len(65)), long, rtol=1e-6)
    assert not torch.allclose(short, long)


def test_explicit_attention_factor_and_su_name():
    rope = {"rope_type": "su", "short_factor": SHORT, "long_factor": LONG,
            "attention_factor": 1.25}
    cfg = config_from_hf({**PHI4_MINI, "rope_scaling": rope})
    assert cfg.longrope.attention_factor == 1.25


def test_longrope_config_round_trips_through_json():
    cfg = config_from_hf(PHI4_MINI).for_max_seq_len(1024)
    back = DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.longrope.long
    assert back.num_parameters == sum(math.prod(s) for s in param_shapes(back).values())


def test_partial_rotary_passes_the_tail_through():
    x = torch.randn(3, 2, 16)
    pos = torch.arange(3).float()[:, None] * torch.ones(6)
    emb = torch.cat((pos, pos), dim=-1)[:, None, :]
    out = apply_rope(x, emb.cos(), emb.sin())
    assert torch.equal(out[..., 12:], x[..., 12:])
    assert not torch.allclose(out[1:, :, :12], x[1:, :, :12])


@pytest.mark.parametrize("change,key,value", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type", "yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type", "linear"),
    ({"rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                       "short_mscale": 1.1}}, "rope_scaling.short_mscale", 1.1),
    ({"hidden_act": "gelu_new"}, "hidden_act", "gelu_new"),
    ({"partial_rotary_factor": 0.5625}, "partial_rotary_factor", 0.5625),   # 9 rotary dims
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor", 1.5),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping", 30.0),
])
def test_math_changes_are_refused_by_name(change, key, value):
    with pytest.raises(UnsupportedConfig) as e:
        config_from_hf({**PHI4_MINI, **change})
    assert (e.value.key, e.value.value) == (key, value)
    assert "'phi3'" in str(e.value) and "supported:" in str(e.value)


def test_misshapen_longrope_factors_are_refused():
    rope = {"type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG}
    with pytest.raises(ValueError, match=r"short_factor must be a list of rotary_dim/2 = 6"):
        config_from_hf({**PHI4_MINI, "rope_scaling": rope})


def test_partial_rotary_still_refused_where_not_read():
    llama = {**PHI4_MINI, "model_type": "llama", "rope_scaling": None}
    with pytest.raises(UnsupportedConfig) as e:
        config_from_hf(llama)
    assert e.value.key == "partial_rotary_factor"


def test_fused_tables_name_what_is_missing_or_extra():
    cfg = config_from_hf(PHI4_MINI)
    hf = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(2):
        p = f"model.layers.{i}."
        hf |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
               p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight",
               p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
    plan = {m.target: [x.name for x in m.pieces] for m in plan_mapping(cfg, "hf", hf)}
    assert plan["layers.1.feed_forward.w13.weight"] == ["model.layers.1.mlp.gate_up_proj.weight"]
    split = (hf - {"model.layers.0.self_attn.qkv_proj.weight"}) | {
        "model.layers.0.self_attn.q_proj.weight"}
    with pytest.raises(MappingError) as e:
        plan_mapping(cfg, "hf", split)
    assert e.value.missing == [("layers.0.attention.wqkv.weight",
                                "model.layers.0.self_attn.qkv_proj.weight")]
    assert e.value.unused == ["model.layers.0.self_attn.q_proj.weight"]
    gguf = {"token_embd.weight", "output_norm.weight", "rope_factors_long.weight",
            "rope_factors_short.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2)
        for n in ("attn_norm", "ffn_norm", "attn_qkv", "attn_output", "ffn_up", "ffn_down")}
    plan = {m.target: [x.name for x in m.pieces] for m in plan_mapping(cfg, "gguf", gguf)}
    assert plan["layers.0.attention.wqkv.weight"] == ["blk.0.attn_qkv.weight"]
    assert plan["layers.0.feed_forward.w13.weight"] == ["blk.0.ffn_up.weight"]
