"""A tiny random Qwen3 made with transformers' own classes, built into plans (from its HF
directory and from a GGUF written from it) and run by the runtime: greedy tokens equal
transformers', logits within 1e-3; an int8 plan passes its accuracy gate."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from kiln.builder.build import build
from kiln.builder.progress import Progress
from kiln.runtime.engine import Engine
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import load_plan
from kiln.runtime.sampling import SamplingParams
from tests.model.test_sources import _hf_model, _write_gguf, _write_tokenizer

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 77, 200, 31, 9], list(range(40, 51)), [300, 12] * 9 + [7], [3],
           [250, 251, 252, 10, 11], [17] * 6, list(range(100, 130, 3)), [64, 128, 192, 256]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(HF dir, GGUF path, the transformers model) of one tiny random Qwen3."""
    root = tmp_path_factory.mktemp("qwen3")
    model = _hf_model("qwen3", dict(tie_word_embeddings=False, head_dim=32), seed=3)
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    _write_gguf(root / "tiny-qwen3.gguf", "qwen3", model)
    return root / "hf", root / "tiny-qwen3.gguf", model


def _build(tmp_path, source, name: str, precision: dict, backend: str = "aoti",
           max_seq_len: int = 256, max_num_tokens: int = 64):
    spec = {"name": name, "model": {"source": str(source)},
            "target": {"device": "cpu", "backend": backend}, "precision": precision,
            "limits": {"max_batch_size": 8, "max_seq_len": max_seq_len,
                       "max_num_tokens": max_num_tokens},
            "kv_cache": {"tokens_per_block": 16, "memory": "8MiB"},
            "accuracy": {"eval_tokens": 512}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return build(path, tmp_path / "plans" / name, progress=Progress(enabled=False)).path


def _check_plan_matches_transformers(plan_dir, hf_model, prompts=PROMPTS):
    """Greedy tokens equal transformers' generate; the logits of the prefill's last row and
    of the last decode step within 1e-3 of transformers' forward over the whole sequence."""
    plan = load_plan(plan_dir)
    with Engine.from_plan(plan) as eng:
        got = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    ex = Executor.from_plan(load_plan(plan_dir))
    for i, (prompt, res) in enumerate(zip(prompts, got)):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
            full = ref[0, :-1]
            ref_logits = hf_model(full[None]).logits[0]            # [L, vocab]
        assert list(res.token_ids) == ref[0, len(prompt):].tolist(), f"prompt {i}"
        rows = [len(prompt) - 1, len(full) - 1]                  # prefill, last decode step
        blocks = list(range(1, len(full) // 16 + 2))              # 16 tokens a block
        inp = ModelInput.build([full.tolist()], [0], [blocks], 16, logits_indices=rows)
        with torch.inference_mode():
            ours = ex.execute(inp)
        assert ref_logits[rows].std() > 0.1, "logits too flat for a 1e-3 check to mean anything"
        assert (ours - ref_logits[rows]).abs().max().item() < 1e-3, f"prompt {i}"


def test_qwen3_hf_fp32_plan_matches_transformers(qwen3, tmp_path, digest_cache):
    hf_dir, _, hf_model = qwen3
    plan = _build(tmp_path, hf_dir, "qwen3-fp32", {"weights": "fp32"})
    m = json.loads((plan / "plan.json").read_text())
    assert m["model"]["family"] == "qwen3" and m["model"]["config"]["qk_norm"]
    assert m["model"]["config"]["head_dim"] == 32
    _check_plan_matches_transformers(plan, hf_model)


def test_qwen3_gguf_plan_matches_transformers(qwen3, tmp_path, digest_cache):
    _, gguf_path, hf_model = qwen3
    plan = _build(tmp_path, gguf_path, "qwen3-gguf", {"weights": "fp32"}, backend="eager")
    _check_plan_matches_transformers(plan, hf_model)


def test_qwen3_int8_plan_passes_its_gate(qwen3, tmp_path, digest_cache):
    hf_dir, _, _ = qwen3
    plan = _build(tmp_path, hf_dir, "qwen3-int8", {"weights": "int8"})
    acc = json.loads((plan / "plan.json").read_text())["accuracy"]
    assert acc["passed"] and acc["ppl_increase"] <= acc["max_ppl_increase"] == 0.03
    with Engine.from_plan(load_plan(plan)) as eng:
        out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0,
                                                        ignore_eos=True))[0]
    assert len(out.token_ids) == 8
