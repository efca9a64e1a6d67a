"""Tiny random Phi-3s made with transformers' own classes (one plain with a sliding window,
one Phi-4-mini-like with LongRoPE and partial rotary), built into plans from their HF
directories and from GGUFs written from them, run by the runtime: greedy tokens equal
transformers', fp32 logits within 1e-3; an int8 plan passes its accuracy gate.

LongRoPE: a plan whose max_seq_len is at most original_max_position_embeddings (64 here)
uses the short factors, as transformers does for such sequences; a longer plan uses the
long factors for every position, as transformers does for a sequence longer than 64 (its
prompts here are 65 to 100 tokens)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.model.test_qwen3_plans import PROMPTS, _build, _check_plan_matches_transformers
from tests.model.test_sources import _hf_model, _write_gguf, _write_tokenizer

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

WINDOW = 16     # Phi-3-mini-4k's is 2047
ORIGINAL = 64   # LongRoPE's original_max_position_embeddings in the tiny config
LONG_PROMPTS = [[(7 * i + 13 * j) % 300 + 3 for j in range(ORIGINAL + 1 + 5 * i)]
                for i in range(8)]   # 65..100 tokens


def _longrope_kw() -> dict:
    g = torch.Generator().manual_seed(0)
    rope = {"rope_type": "longrope", "partial_rotary_factor": 0.75,   # 12 of 16 dims rotate
            "short_factor": (1 + torch.rand(6, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(6, generator=g)).tolist()}
    return dict(tie_word_embeddings=True, pad_token_id=0, rope_scaling=rope,
                original_max_position_embeddings=ORIGINAL)   # max_position_embeddings 256


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(HF dir, GGUF path, transformers model) of a tiny Phi-3 without rope scaling, its
    sliding window (every layer) shorter than most prompts with their answers."""
    root = tmp_path_factory.mktemp("phi3")
    model = _hf_model("phi3", dict(tie_word_embeddings=False, pad_token_id=0,
                                   sliding_window=WINDOW), seed=5)
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    _write_gguf(root / "tiny-phi3.gguf", "phi3", model)
    return root / "hf", root / "tiny-phi3.gguf", model


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    """(HF dir, GGUF path, transformers model) of a tiny LongRoPE, partial-rotary Phi-3."""
    root = tmp_path_factory.mktemp("phi3-longrope")
    model = _hf_model("phi3", _longrope_kw(), seed=6)
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    _write_gguf(root / "tiny-phi3-longrope.gguf", "phi3", model)
    return root / "hf", root / "tiny-phi3-longrope.gguf", model


def _config(plan_dir) -> dict:
    return json.loads((plan_dir / "plan.json").read_text())["model"]["config"]


def test_phi3_hf_fp32_aoti_plan_matches_transformers(phi3, tmp_path, digest_cache):
    hf_dir, _, hf_model = phi3
    plan = _build(tmp_path, hf_dir, "phi3-fp32", {"weights": "fp32"}, backend="aoti")
    cfg = _config(plan)
    assert cfg["family"] == "phi3" and cfg["sliding_window"] == WINDOW and cfg["longrope"] is None
    _check_plan_matches_transformers(plan, hf_model, PROMPTS)


def test_phi3_gguf_plan_matches_transformers(phi3, tmp_path, digest_cache):
    _, gguf_path, hf_model = phi3
    plan = _build(tmp_path, gguf_path, "phi3-gguf", {"weights": "fp32"}, backend="eager")
    assert _config(plan)["sliding_window"] == WINDOW
    _check_plan_matches_transformers(plan, hf_model, PROMPTS)


def test_longrope_short_plan_matches_transformers(phi3_longrope, tmp_path, digest_cache):
    """max_seq_len 64 = original_max_position_embeddings: the short factors, as
    transformers uses for every sequence of at most 64 tokens."""
    hf_dir, _, hf_model = phi3_longrope
    plan = _build(tmp_path, hf_dir, "phi3-lr-short", {"weights": "fp32"}, backend="eager",
                  max_seq_len=ORIGINAL)
    cfg = _config(plan)
    assert cfg["longrope"]["long"] is False and cfg["partial_rotary_factor"] == 0.75
    assert cfg["longrope"]["attention_factor"] == pytest.approx(
        hf_model.model.rotary_emb.attention_scaling)
    _check_plan_matches_transformers(plan, hf_model, PROMPTS)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_longrope_long_plan_matches_transformers(phi3_longrope, tmp_path, digest_cache,
                                                 source):
    """max_seq_len 256 > 64: the long factors at every position, as transformers uses for
    a sequence longer than 64 tokens (from its prefill on)."""
    hf_dir, gguf_path, hf_model = phi3_longrope
    plan = _build(tmp_path, hf_dir if source == "hf" else gguf_path, f"phi3-lr-{source}",
                  {"weights": "fp32"}, backend="eager", max_num_tokens=128)
    assert _config(plan)["longrope"]["long"] is True   # (128: one step runs a whole sequence)
    _check_plan_matches_transformers(plan, hf_model, LONG_PROMPTS)


@pytest.mark.parametrize("which", ["phi3", "phi3_longrope"])
def test_int8_plan_passes_its_gate(request, tmp_path, digest_cache, which):
    hf_dir, _, _ = request.getfixturevalue(which)
    plan = _build(tmp_path, hf_dir, f"{which}-int8", {"weights": "int8"}, backend="eager")
    acc = json.loads((plan / "plan.json").read_text())["accuracy"]
    assert acc["passed"] and acc["ppl_increase"] <= acc["max_ppl_increase"] == 0.03
