"""The plan store: publish, pointer moves, rollback, prune (fake plans, no model)."""
from __future__ import annotations

import json

import pytest

from kiln.builder.plan_ci.records import PlanRecord
from kiln.builder.plan_ci.store import PlanStore, StoreError

pytestmark = pytest.mark.unit


def fake_plan(store: PlanStore, name: str, fp: str, created: str,
              draft: str | None = None) -> None:
    """A plan of `name` under fingerprint fp (draft: the fingerprint of its draft plan)."""
    d = store.staging_dir(name)
    (d / "engine.pt2").write_bytes(b"x" * 10)
    extra = {} if draft is None else {"speculative": {"method": "draft", "draft": {
        "name": "d", "fingerprint": draft, "path": f"../{draft}"}}}
    (d / "plan.json").write_text(json.dumps({
        "name": name, "fingerprint": fp, "created_at": created,
        "files": {"engine.pt2": {"size": 10, "sha256": "0" * 64}}, **extra}))
    store.add_plan(d, fp, PlanRecord(name=name))
    assert not d.exists()


def test_publish_rollback_and_prune(tmp_path):
    s = PlanStore(tmp_path / "store")
    for i, fp in enumerate(["f1", "f2", "f3", "f4"]):
        fake_plan(s, "m", fp, f"2025-01-0{i + 1}T00:00:00Z")
        s.set_current("m", fp)
    fake_plan(s, "other", "o1", "2025-01-01T00:00:00Z")
    s.set_current("other", "o1")
    assert s.current("m") == "f4" and s.pointer("m").history == ("f3", "f2", "f1")
    assert s.names() == ["m", "other"]

    assert s.pointer("m").pinned_from is None
    assert s.rollback("m").fingerprint == "f3"            # the previous one
    assert s.pointer("m").history == ("f4", "f2", "f1")
    assert s.pointer("m").pinned_from == "f4"              # kiln ci keeps it while f4 holds
    assert s.rollback("m", to="f1").fingerprint == "f1"    # a chosen one (prefix)
    assert s.pointer("m").pinned_from == "f4"
    with pytest.raises(StoreError, match="matches 0 plans"):
        s.rollback("m", to="zz")
    with pytest.raises(StoreError, match="no current plan"):
        s.rollback("nobody")

    removed = s.prune("m", keep=1)           # the newest (f4, also pinned_from) + current f1
    assert sorted(removed) == ["f2", "f3"]
    assert sorted(p.name for p in s.plans.iterdir()) == ["f1", "f4", "o1"]
    assert s.pointer("m").history == ("f4",) and s.record("f2") is None
    assert s.current("other") == "o1"                      # another spec is never touched
    assert s.rollback("m", to="f4").pinned_from is None    # back on the spec's own plan


def test_prune_keeps_a_draft_plan_a_stored_plan_drafts_with(tmp_path):
    """Draft plans d1..d3 of spec "d"; target t1 (kept by its own spec) drafts with d1:
    pruning "d" to one plan keeps the newest (d3) and d1, removes d2; once t1 is pruned
    too, d1 goes at the next prune."""
    s = PlanStore(tmp_path / "store")
    for i, fp in enumerate(["d1", "d2", "d3"]):
        fake_plan(s, "d", fp, f"2025-01-0{i + 1}T00:00:00Z")
        s.set_current("d", fp)
    fake_plan(s, "t", "t1", "2025-01-01T00:00:00Z", draft="d1")
    fake_plan(s, "t", "t2", "2025-01-02T00:00:00Z", draft="d3")
    s.set_current("t", "t2")
    assert s.drafts_in_use() == {"d1", "d3"}
    assert s.prune("d", keep=1) == ["d2"]
    assert s.prune("t", keep=1) == ["t1"]
    assert s.prune("d", keep=1) == ["d1"]
    assert sorted(p.name for p in s.plans.iterdir()) == ["d3", "t2"]


def test_incomplete_plan_is_not_in_the_store(tmp_path):
    s = PlanStore(tmp_path / "store")
    fake_plan(s, "m", "f1", "2025-01-01T00:00:00Z")
    assert s.has("f1")
    (s.plan_dir("f1") / "engine.pt2").write_bytes(b"short")
    assert not s.has("f1")
    with pytest.raises(StoreError, match="no complete plan"):
        s.set_current("m", "f1")
    fake_plan(s, "m", "f1", "2025-01-01T00:00:00Z")        # republishing repairs it
    assert s.has("f1")


def test_pointer_is_replaced_atomically(tmp_path):
    s = PlanStore(tmp_path / "store")
    fake_plan(s, "m", "f1", "2025-01-01T00:00:00Z")
    s.set_current("m", "f1")
    assert [p.name for p in s.current_dir.iterdir()] == ["m.json"]   # no temp files left
    data = json.loads((s.current_dir / "m.json").read_text())
    assert data["fingerprint"] == "f1" and data["history"] == []


def test_package_digest_is_recorded_beside_the_plan_and_pruned_with_it(tmp_path):
    from typer.testing import CliRunner

    from kiln.cli import app

    s = PlanStore(tmp_path / "store")
    for i, fp in enumerate(["f1", "f2"]):
        fake_plan(s, "m", fp, f"2025-01-0{i + 1}T00:00:00Z")
        s.set_current("m", fp)
    args = ["ci", "current", "m", "--store", str(s.root), "--oci-digest"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "has not been packaged" in r.output
    s.record_package("f1", "sha256:" + "1" * 64, "sha256:" + "2" * 64, "3" * 64)
    s.record_package("f2", "sha256:" + "4" * 64, "sha256:" + "5" * 64, "6" * 64)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and r.output.strip() == "sha256:" + "4" * 64
    assert s.prune("m", keep=1) == ["f1"]
    assert s.package("f1") is None and s.package("f2")["plan_digest"] == "6" * 64
