"""Each architecture family builds and gates quantized plans in CI: a diagonal of the matrix
bench/models_matrix.py builds in full (docs/MODELS.md, every precision and KV cache on every
architecture). Two cells per architecture, chosen so that each precision runs on at least two
families and each family on two precisions (eager plans, seconds each)."""
from __future__ import annotations

import pytest

from bench.models_matrix import PRECISIONS, architectures, run_cell
from tests.model.test_sources import _write_tokenizer

pytestmark = pytest.mark.model
pytest.importorskip("transformers")

BY_LABEL = {p.label: p for p in PRECISIONS}
DIAGONAL = {
    "llama": ("int4", "fp8"),
    "mistral": ("W4A8", "bf16"),
    "qwen2": ("fp8", "W8A8"),
    "qwen3": ("W4A8", "fp32 + KV fp8"),
    "gemma2": ("int4", "fp32 + KV int8"),
    "gemma3_text": ("fp8", "fp32 + KV fp8"),
    "phi3": ("W8A8", "int4"),
    "phi3_longrope": ("bf16", "int8"),
    "mixtral": ("W4A8", "fp32 + KV int8"),
    "qwen3_moe": ("W8A8", "int8"),
}


def test_the_diagonal_covers_every_precision_twice():
    counts = {p.label: 0 for p in PRECISIONS if p.label != "fp32"}
    for labels in DIAGONAL.values():
        for label in labels:
            counts[label] += 1
    assert min(counts.values()) >= 2, counts
    assert set(DIAGONAL) == {a.name for a in architectures()}


@pytest.mark.parametrize("arch", list(DIAGONAL))
def test_architecture_builds_and_gates_its_precisions(arch, tmp_path, digest_cache):
    a = next(x for x in architectures() if x.name == arch)
    model = a.make()
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    _write_tokenizer(hf)
    for label in DIAGONAL[arch]:
        cell = run_cell(tmp_path, a, "hf", hf, model, BY_LABEL[label], "eager")
        assert cell.status == "passed", (label, cell.status, cell.detail)
        assert cell.max_ppl_increase is not None, f"{label}: no accuracy gate ran"
        assert cell.ppl_increase <= cell.max_ppl_increase
