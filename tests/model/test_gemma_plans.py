"""Tiny random Gemma 2 and Gemma 3 (text) made with transformers' own classes, built into
plans from their HF directories and from GGUFs written as llama.cpp's converter writes them
(norm weights stored as 1 + w), run by the runtime: greedy tokens equal transformers', fp32
logits within 1e-3; an int8 plan passes its accuracy gate. Their sliding window (16) is
shorter than the longest prompt plus its answer, and Gemma 2 soft-caps its attention scores.

llama.cpp's GGUF has no key for query_pre_attn_scalar (it scales by head_dim ** -0.5), so
each GGUF is written from a twin of the HF model (same weights) with query_pre_attn_scalar =
head_dim. Gemma 3's linear rope scaling of its global layers is in both."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.builder.arch.config import UnsupportedConfig
from kiln.builder.arch.families import config_from_hf
from kiln.builder.sources import open_checkpoint
from kiln.builder.spec import ModelSpec
from tests.model.test_qwen3_plans import _build, _check_plan_matches_transformers
from tests.model.test_sources import TINY, _add_tokenizer, _write_tokenizer

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

WINDOW = 16
HEAD_DIM = 32          # hidden / heads is 16: Gemma reads its own head_dim
G3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
           "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}}
CASES = {   # version -> (config class, model class, config.json keys beyond TINY)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, attn_logit_softcapping=20.0,
                    final_logit_softcapping=5.0)),
    # six layers: five sliding, one global (the default pattern, llama.cpp's too)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=6, final_logit_softcapping=None, rope_parameters=G3_ROPE)),
}


def _gemma(version: str, gguf_twin: bool = False):
    conf_cls, model_cls, extra = CASES[version]
    kw = dict(TINY, head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=24,
              tie_word_embeddings=True)
    kw.update(extra)
    if gguf_twin:
        kw["query_pre_attn_scalar"] = HEAD_DIM
    torch.manual_seed(7)
    model = getattr(transformers, model_cls)(getattr(transformers, conf_cls)(**kw)).eval()
    with torch.no_grad():   # HF inits Gemma's norms to 0 (a scale of 1): make mapping errors show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.generation_config.eos_token_id = None
    return model


# llama.cpp's tensor names for the HF ones (blk.N. for model.layers.N.)
GGUF_NAMES = {"input_layernorm": "attn_norm",
              "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gemma_gguf(path, arch: str, model) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for Gemma2/Gemma3ForCausalLM (F32)."""
    import gguf
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:                     # the local base is llama.cpp's built-in 10000
        glob = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(glob["rope_theta"])
        if glob["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(glob["factor"])
    _add_tokenizer(w, "smollm")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":      # tied: llama.cpp skips it
            continue
        t = t.detach().float()
        if name.endswith("norm.weight"):  # the converter stores Gemma's 1 + w
            t = t + 1
        out = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight"}.get(name)
        if out is None:
            out = name.removeprefix("model.").replace("layers.", "blk.")
            for hf, gg in GGUF_NAMES.items():
                out = out.replace(hf, gg)
        w.add_tensor(out, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory):
    """(version, HF dir, its transformers model, GGUF path, the GGUF's transformers twin)."""
    version = request.param
    root = tmp_path_factory.mktemp(version)
    model, twin = _gemma(version), _gemma(version, gguf_twin=True)
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    _write_gemma_gguf(root / f"tiny-{version}.gguf", version, twin)
    return version, root / "hf", model, root / f"tiny-{version}.gguf", twin


def test_gemma_hf_fp32_plan_matches_transformers(gemma, tmp_path, digest_cache):
    version, hf_dir, model, _, _ = gemma
    backend = "aoti" if version == "gemma2" else "eager"   # one compiled build (2 cores)
    plan = _build(tmp_path, hf_dir, f"{version}-fp32", {"weights": "fp32"}, backend=backend)
    m = json.loads((plan / "plan.json").read_text())
    cfg = m["model"]["config"]
    assert m["model"]["family"] == ("gemma2" if version == "gemma2" else "gemma3_text")
    assert cfg["post_norms"] and cfg["sliding_window"] == WINDOW
    assert cfg["qk_norm"] == (version == "gemma3")
    assert m["model"]["num_parameters"] == sum(p.numel() for p in model.parameters())
    _check_plan_matches_transformers(plan, model)


def test_gemma_gguf_plan_matches_transformers(gemma, tmp_path, digest_cache):
    version, hf_dir, _, gguf_path, twin = gemma
    ckpt = open_checkpoint(ModelSpec(source=str(gguf_path)))
    ref = config_from_hf(twin.config.to_dict())
    for key in ("sliding_window", "sliding_layers", "attn_logit_softcap",
                "final_logit_softcap", "query_scale", "rope_theta", "rope_local_theta",
                "rope_global_factor",
                "qk_norm", "post_norms", "head_dim", "tie_word_embeddings"):
        assert getattr(ckpt.config, key) == getattr(ref, key), key
    # the GGUF's norms (1 + w) come back as the HF checkpoint's w
    hf = {f"{n}": p.detach() for n, p in twin.state_dict().items()}
    got = dict(ckpt.tensors())
    assert torch.allclose(got["layers.1.post_ffn_norm.weight"],
                          hf["model.layers.1.post_feedforward_layernorm.weight"], atol=1e-6)
    plan = _build(tmp_path, gguf_path, f"{version}-gguf", {"weights": "fp32"}, backend="eager")
    _check_plan_matches_transformers(plan, twin)


def test_gemma_int8_plan_passes_its_gate(gemma, tmp_path, digest_cache):
    version, hf_dir, _, _, _ = gemma
    plan = _build(tmp_path, hf_dir, f"{version}-int8", {"weights": "int8"}, backend="eager")
    acc = json.loads((plan / "plan.json").read_text())["accuracy"]
    assert acc["passed"] and acc["ppl_increase"] <= acc["max_ppl_increase"]


# --- refusals (no model) ------------------------------------------------------------------

def _config_json(version: str, **over) -> dict:
    conf_cls, _, extra = CASES[version]
    d = getattr(transformers, conf_cls)(**{**TINY, **extra}, head_dim=HEAD_DIM,
                                        sliding_window=WINDOW).to_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("version,key,value", [
    ("gemma2", "hidden_activation", "gelu"),
    ("gemma2", "attention_bias", True),
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma2", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ("gemma3", "rope_parameters", {**G3_ROPE, "full_attention": {"rope_type": "yarn",
                                                                 "factor": 2.0}}),
    ("gemma3", "layer_types", ["sliding_attention", "chunked_attention"] * 3),
])
def test_gemma_refuses_what_it_does_not_implement(version, key, value):
    with pytest.raises(UnsupportedConfig) as e:
        config_from_hf(_config_json(version, **{key: value}))
    assert e.value.key.split(".")[0] == key and "supported: " in str(e.value)


def test_gemma3_image_text_checkpoint_builds_its_text_model(tmp_path, digest_cache):
    """Gemma3ForConditionalGeneration (model_type gemma3): the plan is its language model,
    the vision tower and projector left unread; tokens and logits equal transformers' on
    text prompts."""
    text = {**TINY, **CASES["gemma3"][2], "head_dim": HEAD_DIM, "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "hf")
    _write_tokenizer(tmp_path / "hf")
    plan = _build(tmp_path, tmp_path / "hf", "gemma3-it", {"weights": "fp32"}, backend="eager")
    m = json.loads((plan / "plan.json").read_text())
    assert m["model"]["family"] == "gemma3" and m["model"]["config"]["qk_norm"]
    _check_plan_matches_transformers(plan, model)


def test_gemma_older_config_keys():
    """config.json written by transformers 4.x: rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of rope_parameters and layer_types."""
    d = _config_json("gemma3")
    for k in ("rope_parameters", "layer_types"):
        d.pop(k)
    d.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = config_from_hf(d)
    assert cfg.sliding_layers == (0, 1, 3, 4) and cfg.window_for(2) == 0
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_global_factor) == (1e6, 1e4, 8.0)
    g2 = config_from_hf({**_config_json("gemma2"), "layer_types": None})
    assert g2.sliding_layers == (0, 2) and g2.attn_logit_softcap == 20.0
