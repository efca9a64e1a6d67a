"""The plan manifest's type (kiln.contracts.manifest): an exact JSON round trip, a bad field
named, no torch needed. No model: the manifest is written by hand."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kiln.contracts import PLAN_FORMAT_VERSION, FieldError
from kiln.contracts.manifest import GoldenPrompt, ManifestError, PlanManifest

pytestmark = pytest.mark.unit

MANIFEST = {
    "format_version": PLAN_FORMAT_VERSION, "name": "t", "fingerprint": "f" * 64,
    "fingerprint_inputs": {"spec": "s", "weights": "w"}, "quick_key": None,
    "created_at": "2026-12-01T00:00:00Z", "spec_path": "model_specs/t.yaml",
    "spec": {"name": "t", "target": {"isa": "avx2"}, "golden": [{"prompt": "hi"}]},
    "model": {"family": "llama", "num_parameters": 10, "source": "random seed 0",
              "source_path": None, "weights_digest": "w",
              "config": {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                         "hidden_size": 64, "vocab_size": 384, "rope_theta": 10000.0}},
    "target": {"device": "cpu", "arch": "x86_64", "isa": "avx2", "isa_flags": ["-mavx2"],
               "cpu_features": ["avx2"], "compute_capability": None},
    "toolchain": {"kiln": "0.3.0", "torch": "2.13.0", "python": "3.11.7",
                  "ops": "0123456789abcdef"},
    "precision": {"weights": "fp32", "kv_cache": "fp32", "activations": "fp32",
                  "quantization": {"weights": "fp32", "scheme": None}},
    "limits": {"max_batch_size": 8, "max_seq_len": 256, "max_input_len": 255,
               "max_num_tokens": 64},
    "kv_cache": {"tokens_per_block": 16, "dtype": "fp32", "memory": "8MiB",
                 "budget_bytes": 8388608, "budget_fraction": None,
                 "pool_order": "block_head_token"},
    "scheduler": {"policy": "max_utilization", "chunked_prefill": True, "prefix_caching": True,
                  "max_queue": 1024},
    "engine": {"backend": "aoti", "file": "engine.pt2", "kernels": ["kernels/k.so"],
               "plugins": ["paged_kv"], "kernel_paths": {"kernels/k.so": "avx2"},
               "inputs": ["input_ids"]},
    "check": {"max_logit_diff": 1e-7, "tolerance": 1e-3},
    "accuracy": None,
    "files": {"engine.pt2": {"size": 3, "sha256": "0" * 64},
              "kernels/k.so": {"size": 4, "sha256": "1" * 64}},
}


def test_round_trip_is_exact_and_typed():
    m = PlanManifest.from_json(copy.deepcopy(MANIFEST))
    assert m.to_json() == MANIFEST
    assert json.loads(m.dumps()) == MANIFEST
    assert m.limits.max_seq_len == 256 and m.engine.kernels == ("kernels/k.so",)
    assert m.model.shape.num_kv_heads == 2 and m.files["engine.pt2"].size == 3
    assert m.pinned_isa == "avx2" and m.golden == (GoldenPrompt(prompt="hi"),) \
        and m.total_bytes == 7


def test_kv_pool_order_of_older_plans_and_bad_values():
    """A plan that predates kv_cache.pool_order was captured on [block, token, head] pools and
    reads as such (its runtime allocates them so); an unknown order is named."""
    data = copy.deepcopy(MANIFEST)
    del data["kv_cache"]["pool_order"]
    assert PlanManifest.from_json(data).kv_cache.pool_order == "block_token_head"
    data["kv_cache"]["pool_order"] = "head_block_token"
    with pytest.raises(ManifestError, match=r"kv_cache\.pool_order.*block_head_token"):
        PlanManifest.from_json(data)


def test_quantization_record_keeps_the_keys_it_was_written_with():
    """A packed record always has its core keys (group_size null for int8) and the others
    only when set: the round trip is exact either way; an unknown key is named."""
    int8 = {"weights": "int8", "scheme": "int8", "group_size": None, "group_size_source": None,
            "method": "rtn", "activations": "float", "kept": [], "quantized": ["w1", "output"],
            "awq_alpha": {}, "embedding": "int8-per-row", "bytes_before": 8, "bytes_after": 2}
    int4 = {**int8, "weights": "int4", "scheme": "int4_a8", "group_size": 32,
            "group_size_source": "auto", "method": "awq", "awq_alpha": {"w1": 0.5},
            "int4_layout_kept": ["w2"], "calibration": "not used"}
    for q in (int8, int4):
        data = copy.deepcopy(MANIFEST)
        data["precision"]["quantization"] = q
        m = PlanManifest.from_json(data)
        assert m.to_json() == data
    assert m.precision.quantization.int4_layout_kept == ("w2",)
    data["precision"]["quantization"] = {**int8, "bogus": 1}
    with pytest.raises(ManifestError, match=r"precision\.quantization\.bogus"):
        PlanManifest.from_json(data)


@pytest.mark.parametrize("edit,field", [
    (lambda m: m["limits"].update(max_seq_len="256"), "limits.max_seq_len"),
    (lambda m: m["files"]["engine.pt2"].pop("sha256"), 'files["engine.pt2"].sha256'),
    (lambda m: m["engine"].update(kernels=["a", 3]), "engine.kernels[1]"),
    (lambda m: m["model"]["config"].pop("head_dim"), "model.config.head_dim"),
    (lambda m: m["scheduler"].update(extra=1), "scheduler.extra"),
    (lambda m: m["limits"].update(max_input_len=256), "limits.max_input_len"),
    (lambda m: m.update(format_version=PLAN_FORMAT_VERSION + 1), "format_version"),
])
def test_a_bad_field_is_named(edit, field):
    data = copy.deepcopy(MANIFEST)
    edit(data)
    with pytest.raises(ManifestError) as e:
        PlanManifest.from_json(data)
    assert e.value.field == field and isinstance(e.value, FieldError)
    assert str(e.value).startswith(field)


WEIGHTS = {"file": "weights.bin", "tensors": {
    "embed.weight": {"offset": 0, "dtype": "float32", "shape": [8, 4], "stride": [4, 1]},
    "lm_head.weight": {"offset": 0, "dtype": "float32", "shape": [8, 4], "stride": [4, 1]}}}


def test_the_engine_weights_section_round_trips_and_is_checked():
    """A CPU plan's engine.weights (a mapped file and each constant's place in it) round-trips;
    a plan without one writes no key; a stride that does not fit the shape is named."""
    data = copy.deepcopy(MANIFEST)
    assert "weights" not in PlanManifest.from_json(data).to_json()["engine"]
    data["engine"]["weights"] = copy.deepcopy(WEIGHTS)
    m = PlanManifest.from_json(data)
    assert m.to_json() == data and m.engine.weights.tensors["embed.weight"].shape == (8, 4)
    data["engine"]["weights"]["tensors"]["embed.weight"]["stride"] = [1]
    with pytest.raises(ManifestError) as e:
        PlanManifest.from_json(data)
    assert e.value.field == 'engine.weights.tensors["embed.weight"].stride'


def test_the_contract_imports_no_torch():
    code = ("import sys, kiln.contracts.manifest, kiln.builder.uptodate; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
