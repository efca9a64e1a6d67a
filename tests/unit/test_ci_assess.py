"""kiln ci's reasons (fingerprint input diffs), the spec's golden_agreement, verify's token
agreement (no model)."""
from __future__ import annotations

import pytest

from kiln.builder.plan_ci.assess import diff_inputs
from kiln.builder.spec import SpecError, parse_spec
from kiln.contracts.manifest import GoldenPrompt, StoredPlan
from kiln.runtime.tools.verify import golden_prompts, token_agreement

pytestmark = pytest.mark.unit

SPEC = """
name: t
model: {source: random, arch: {vocab_size: 320, hidden_size: 32, intermediate_size: 64,
        num_hidden_layers: 1, num_attention_heads: 2}}
limits: {max_batch_size: 4, max_seq_len: 128, max_num_tokens: 32}
"""
INPUTS = {"spec": "s1", "weights": "w" * 64,
          "toolchain": {"kiln": "0.1.0", "torch": "2.13.0"},
          "target": {"device": "cpu", "arch": "x86_64", "isa": "avx2", "compute_capability": None}}


def test_golden_agreement_is_validated_and_unset_keeps_the_fingerprint():
    plain = parse_spec(SPEC)
    assert "golden_agreement" not in plain.canonical()
    spec = parse_spec(SPEC + "golden_agreement: 0.9\n")
    assert spec.golden_agreement == 0.9 and spec.digest() != plain.digest()
    with pytest.raises(SpecError, match="golden_agreement"):
        parse_spec(SPEC + "golden_agreement: 1.5\n")


def test_diff_names_each_changed_input():
    old_spec = parse_spec(SPEC)
    new_spec = parse_spec(SPEC.replace("max_batch_size: 4", "max_batch_size: 2")
                          + "golden: [{prompt: hi, max_tokens: 3}]\n")
    prev = StoredPlan.from_json({"spec": old_spec.canonical(), "fingerprint_inputs": INPUTS})
    new = {**INPUTS, "spec": "s2", "weights": "v" * 64,
           "toolchain": {"kiln": "0.2.0", "torch": "2.13.0"},
           "target": {**INPUTS["target"], "isa": "avx512"}}
    got = {c.input: c.detail for c in diff_inputs(prev, new, new_spec)}
    assert list(got) == ["spec", "weights", "toolchain", "target"]
    assert "limits.max_batch_size: 4 -> 2" in got["spec"]
    assert "golden[0]: (unset) -> {'prompt': 'hi'" in got["spec"]
    assert got["weights"] == f"sha256 {'w' * 12} -> {'v' * 12}"
    assert got["toolchain"] == "kiln: '0.1.0' -> '0.2.0'"
    assert got["target"] == "isa: 'avx2' -> 'avx512'"
    assert diff_inputs(prev, INPUTS, old_spec) == []


def test_token_agreement_and_golden_keys():
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert token_agreement([[1, 2, 9, 4]], [[1, 2, 3, 4]]) == 0.75
    assert token_agreement([[1, 2]], [[1, 2, 3, 4]]) == 0.5        # a shorter output counts
    assert token_agreement([], []) == 1.0
    manifest = {"spec": {"golden": [{"prompt": "hi", "chat": True, "max_tokens": 3}]}}
    g = golden_prompts(tuple(GoldenPrompt.from_json(d) for d in manifest["spec"]["golden"]))
    assert g == [GoldenPrompt(prompt="hi", chat=True, max_tokens=3, expected=None)]
    assert g[0].key == "chat|3|hi"
    assert golden_prompts(())[0].default is True
