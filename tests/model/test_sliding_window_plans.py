"""Models with a sliding window, made with transformers' own classes and built into plans
whose max_seq_len is far past the window: a tiny random Mistral (every layer windowed) and a
Qwen2 with use_sliding_window (global and windowed layers mixed). Greedy tokens equal
transformers', fp32 logits within 1e-3, on prompts longer than the window; the engine's
chunked prefill crosses the window."""
from __future__ import annotations

import json

import pytest
import torch

from tests.model.test_qwen3_plans import _build, _check_plan_matches_transformers
from tests.model.test_sources import TINY, _write_tokenizer

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

WINDOW = 16
# several prompts longer than the window (up to 2.5 windows before the 16 new tokens), and
# with these 8 prompts the engine's 64-token steps split prefills into chunks
PROMPTS = [list(range(40, 80)), [5, 77, 200, 31, 9], [300, 12] * 12 + [7],
           list(range(100, 220, 4)), [3], [17] * 20, list(range(250, 270)), [64, 128, 192]]


def _tiny(cls_cfg, cls_model, seed: int, **kw):
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**TINY, **kw)).eval()
    with torch.no_grad():   # HF inits norms to 1 and biases to 0: make mapping errors show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None   # always generate the new tokens
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    model = _tiny(transformers.MistralConfig, transformers.MistralForCausalLM, seed=5,
                  sliding_window=WINDOW, tie_word_embeddings=False)
    model.save_pretrained(root)
    _write_tokenizer(root)
    return root, model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Qwen2 with its window on the layers from max_window_layers on: layer 0 global."""
    root = tmp_path_factory.mktemp("qwen2-window")
    model = _tiny(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, seed=6,
                  sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    model.save_pretrained(root)
    _write_tokenizer(root)
    return root, model


def test_prompts_cross_the_window(mistral):
    """The check means something: past the window the model's own output differs from the
    same weights attending to the whole context."""
    _, model = mistral
    x = torch.tensor([PROMPTS[0]])
    full = transformers.MistralForCausalLM(
        transformers.MistralConfig(**{**model.config.to_dict(), "sliding_window": None}))
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(x).logits - full.eval()(x).logits).abs().max() > 1e-2


def test_mistral_plan_past_its_window_matches_transformers(mistral, tmp_path, digest_cache):
    hf_dir, model = mistral
    plan = _build(tmp_path, hf_dir, "mistral-window", {"weights": "fp32"}, max_seq_len=128)
    cfg = json.loads((plan / "plan.json").read_text())["model"]["config"]
    assert cfg["sliding_window"] == WINDOW and cfg["sliding_layers"] == []
    _check_plan_matches_transformers(plan, model, PROMPTS)


def test_qwen2_windowed_layers_plan_matches_transformers(qwen2, tmp_path, digest_cache):
    hf_dir, model = qwen2
    plan = _build(tmp_path, hf_dir, "qwen2-window", {"weights": "fp32"}, backend="eager",
                  max_seq_len=128)
    cfg = json.loads((plan / "plan.json").read_text())["model"]["config"]
    assert cfg["sliding_window"] == WINDOW and cfg["sliding_layers"] == [1]
    _check_plan_matches_transformers(plan, model, PROMPTS)
