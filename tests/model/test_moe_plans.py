"""Tiny random Mixtral and Qwen3-MoE made with transformers' own classes, built into plans and
run by the runtime: greedy tokens equal transformers' for 8 prompts, fp32 logits within 1e-3;
a checkpoint whose experts disagree with its config is refused naming what differs."""
from __future__ import annotations

import json

import pytest
import torch

from kiln.builder.sources import open_checkpoint
from kiln.builder.spec import ModelSpec
from tests.model.test_qwen3_plans import _build, _check_plan_matches_transformers
from tests.model.test_sources import TINY, _write_gguf, _write_tokenizer

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

ROPE = {"rope_type": "default", "rope_theta": 10000.0}   # the GGUF writer's base
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}   # llama.cpp's names
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                     rope_parameters=ROPE)),
    # many small experts, top-4 renormalized; layer 1 keeps the dense MLP (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                       head_dim=32, tie_word_embeddings=False, rope_parameters=ROPE)),
}


def moe_model(family: str, seed: int = 0, **overrides):
    """A tiny random transformers MoE model (eval mode, norms perturbed off 1)."""
    cfg_cls, model_cls, kw = MOE[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **kw, **overrides})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=list(MOE))
def moe_hf(request, tmp_path_factory):
    """(family, HF dir, transformers model) of one tiny random MoE model."""
    root = tmp_path_factory.mktemp(request.param)
    model = moe_model(request.param, seed=5)
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    return request.param, root / "hf", model


def test_moe_fp32_plan_matches_transformers(moe_hf, tmp_path, digest_cache):
    family, hf_dir, hf_model = moe_hf
    backend = "aoti" if family == "mixtral" else "eager"   # one AOTInductor build
    plan = _build(tmp_path, hf_dir, f"{family}-fp32", {"weights": "fp32"}, backend=backend)
    m = json.loads((plan / "plan.json").read_text())
    cfg = m["model"]["config"]
    assert m["model"]["family"] == family and "moe" in m["engine"]["plugins"]
    assert cfg["num_experts"] == (8 if family == "mixtral" else 16)
    assert cfg["sparse_layers"] == ([0, 1] if family == "mixtral" else [0])
    assert m["model"]["num_parameters"] == sum(p.numel() for p in hf_model.parameters())
    _check_plan_matches_transformers(plan, hf_model)


def test_moe_gguf_plan_matches_transformers(moe_hf, tmp_path, digest_cache):
    family, _, hf_model = moe_hf
    path = tmp_path / f"tiny-{family}.gguf"
    _write_gguf(path, GGUF_ARCH[family], hf_model)
    plan = _build(tmp_path, path, f"{family}-gguf", {"weights": "fp32"}, backend="eager")
    cfg = json.loads((plan / "plan.json").read_text())["model"]["config"]
    assert cfg["num_experts"] == (8 if family == "mixtral" else 16)
    assert cfg["experts_per_token"] == (2 if family == "mixtral" else 4)
    _check_plan_matches_transformers(plan, hf_model)


def test_a_gguf_whose_expert_count_disagrees_with_its_tensors_is_refused(tmp_path,
                                                                        monkeypatch):
    import gguf

    from kiln.builder.sources import load_model

    add = gguf.GGUFWriter.add_expert_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_count", lambda w, n: add(w, n + 1))
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", moe_model("mixtral"))           # expert_count 9, 8 experts
    with pytest.raises(ValueError, match=r"feed_forward\.gate\.weight has shape \[8, 64\], "
                                         r"the model declares \[9, 64\]"):
        load_model(open_checkpoint(ModelSpec(source=str(path))))


def _saved(tmp_path, family: str, **overrides):
    d = tmp_path / "hf"
    moe_model(family, **overrides).save_pretrained(d)
    _write_tokenizer(d)
    return d


def test_a_config_with_more_experts_than_the_checkpoint_is_refused(tmp_path):
    d = _saved(tmp_path, "mixtral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_local_experts=9)))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\.block_sparse_moe"
                                         r"\.experts\.8\.w1\.weight"):
        open_checkpoint(ModelSpec(source=str(d)))


def test_a_checkpoint_with_more_experts_than_the_config_is_refused(tmp_path):
    d = _saved(tmp_path, "qwen3_moe")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_experts=15, num_local_experts=15)))
    with pytest.raises(ValueError, match=r"unexpected tensors.*mlp\.experts\.15\.down_proj"):
        open_checkpoint(ModelSpec(source=str(d)))


def test_a_misshapen_expert_is_refused_naming_it(tmp_path):
    d = _saved(tmp_path, "qwen3_moe")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=16)))
    from kiln.builder.sources import load_model

    with pytest.raises(ValueError, match=r"feed_forward\.experts\.w13"):
        load_model(open_checkpoint(ModelSpec(source=str(d))))


@pytest.mark.parametrize("family,weights,activations,kv", [
    ("mixtral", "int8", "fp32", "fp32"), ("qwen3_moe", "int4", "fp32", "fp32"),
    ("mixtral", "int4", "int8", "fp32"), ("qwen3_moe", "int8", "int8", "fp32"),  # W4A8, W8A8
    ("mixtral", "bf16", "fp32", "int8"), ("qwen3_moe", "fp8", "fp32", "fp8")],
    ids=["mixtral-int8", "qwen3_moe-int4", "mixtral-w4a8", "qwen3_moe-w8a8",
         "mixtral-bf16-kv_int8", "qwen3_moe-fp8-kv_fp8"])
def test_quantized_moe_plan_passes_its_gate(family, weights, activations, kv, tmp_path,
                                            digest_cache):
    hf_dir = _saved(tmp_path, family, seed=5)
    plan = _build(tmp_path, hf_dir, f"{family}-{weights}-{activations}-{kv}",
                  {"weights": weights, "activations": activations, "kv_cache": kv},
                  backend="eager")
    m = json.loads((plan / "plan.json").read_text())
    q, acc = m["precision"]["quantization"], m["accuracy"]
    experts = [n for n in q["quantized"] if n.endswith("feed_forward.experts")]
    assert len(experts) == len(m["model"]["config"]["sparse_layers"])
    # the routers stay float: Mixtral's 8 outputs do not fit W4A8's 16-row tiles
    assert not [n for n in q["quantized"] if n.endswith("feed_forward.gate")]
    assert m["precision"]["kv_cache"] == kv
    assert acc["passed"] and acc["ppl_increase"] <= acc["max_ppl_increase"]
    print(f"{family} {weights} act={activations} kv={kv}: ppl +{acc['ppl_increase']:.4f} "
          f"(limit {acc['max_ppl_increase']})")


def test_quantized_experts_are_refused_for_a_gpu_target():
    from kiln.builder.arch.blocks import DecoderModel
    from kiln.builder.arch.config import DecoderConfig
    from kiln.builder.quantize import quantize_model
    from kiln.contracts import FieldError

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, family="mixtral",
                        num_experts=4, experts_per_token=2, moe_intermediate_size=32,
                        sparse_layers=(0,))
    with pytest.raises(FieldError, match="int8 experts .* have no GPU kernel"):
        quantize_model(DecoderModel(cfg), "int8", device="h100")
    record = quantize_model(DecoderModel(cfg), "bf16", device="h100")   # Triton reads bf16
    assert "layers.0.feed_forward.experts" in record.quantized
