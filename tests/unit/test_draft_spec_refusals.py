"""A draft spec drafts alone: draft_plan naming this spec, a spec that names a draft itself,
or a cycle of two specs is refused, naming the problem."""
from __future__ import annotations

import pytest

from kiln.builder.draft import load_draft_spec
from kiln.builder.spec import SpecError, load_spec

pytestmark = pytest.mark.unit

SPEC = """name: {name}
model:
  source: random
  seed: 0
  arch:
    vocab_size: 320
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 1
    num_attention_heads: 2
    num_key_value_heads: 1
    max_position_embeddings: 256
target:
  device: cpu
  backend: eager
limits:
  max_batch_size: 4
  max_seq_len: 128
  max_num_tokens: 32
speculative:
  method: draft
  draft_plan: {draft}
  max_batch: 4
"""


def _write(d, stem, draft):
    path = d / f"{stem}.yaml"
    path.write_text(SPEC.format(name=stem, draft=draft))
    return path


def _refusal(path) -> str:
    with pytest.raises(SpecError) as e:
        load_draft_spec(load_spec(path), path)
    assert "speculative.draft_plan" in str(e.value)
    return str(e.value)


def test_a_cycle_of_two_specs_is_refused(tmp_path):
    a = _write(tmp_path, "a", "b.yaml")
    _write(tmp_path, "b", "a.yaml")
    assert "a cycle: a.yaml drafts with b.yaml, which drafts with a.yaml" in _refusal(a)


def test_a_spec_naming_itself_is_refused(tmp_path):
    assert "cannot be its own draft" in _refusal(_write(tmp_path, "a", "a.yaml"))


def test_a_draft_spec_naming_a_draft_is_refused(tmp_path):
    a = _write(tmp_path, "a", "b.yaml")
    _write(tmp_path, "b", "../plans/c")
    assert "names a draft itself (../plans/c)" in _refusal(a)


def test_a_plan_directory_is_not_a_draft_spec(tmp_path):
    path = _write(tmp_path, "a", "../plans/c")
    assert load_draft_spec(load_spec(path), path) is None
