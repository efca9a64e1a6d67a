"""The plan store under concurrent kiln ci runs and rollbacks (fake plans, no model): updates
hold the store's lock, pointers move by compare-and-swap, the pointer records its plan's
digest."""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import time
import traceback

import pytest
from typer.testing import CliRunner

from kiln.builder.plan_ci.assess import BUILD, REUSE, Assessment
from kiln.builder.plan_ci.pipeline import _publish, _reuse
from kiln.builder.plan_ci.records import BuildOutcome
from kiln.builder.plan_ci.store import PlanStore, StoreError
from tests.unit.test_ci_store import fake_plan

pytestmark = pytest.mark.unit


def _race_worker(root: str, kind: str, rounds: int, out) -> None:
    """One `kiln ci` run's store updates, repeated: publish a new plan, point at it, prune
    (kind "publish"), or roll back (kind "rollback"). Sends the unexpected errors to `out`."""
    s = PlanStore(root)
    errors = []
    for i in range(rounds):
        try:
            if kind == "publish":
                fp = f"p{os.getpid()}-{i}"
                fake_plan(s, "m", fp, f"2025-01-01T00:00:{time.time():020.6f}Z")
                s.set_current("m", fp)
                s.prune("m", keep=1)
            else:
                s.rollback("m")
        except StoreError:
            pass        # a refusal that says why (no earlier plan, a plan pruned meanwhile)
        except Exception:
            errors.append(traceback.format_exc())
    out.put(errors)


def test_concurrent_runs_never_remove_the_current_plan_nor_crash(tmp_path):
    """Processes publishing, pruning and rolling back on one store at once: every store update
    either happens or is refused with a StoreError, and the plan the pointer names is always
    complete (checked under the store's lock file, which every writer holds)."""
    s = PlanStore(tmp_path / "store")
    fake_plan(s, "m", "f0", "2025-01-01T00:00:00Z")
    s.set_current("m", "f0")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    kinds = ["publish", "publish", "publish", "rollback"]
    procs = [ctx.Process(target=_race_worker, args=(str(s.root), k, 25, out)) for k in kinds]
    for p in procs:
        p.start()
    missing = []
    while any(p.is_alive() for p in procs):
        with open(s.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fp = s.current("m")
            if not s.has(fp):
                missing.append(fp)
    errors = [e for _ in procs for e in out.get(timeout=60)]
    for p in procs:
        p.join(60)
    assert errors == [], errors[0]
    assert missing == [] and s.has(s.current("m"))
    assert len(s.plans_of("m")) <= 1 + 2 + 3      # keep 1, current, pinned, publishes in flight


def test_a_pointer_moves_only_from_where_the_run_found_it(tmp_path):
    s = PlanStore(tmp_path / "store")
    for i, fp in enumerate(["f1", "f2", "f3"]):
        fake_plan(s, "m", fp, f"2025-01-0{i + 1}T00:00:00Z")
    s.set_current("m", "f1", expected=None)
    s.set_current("m", "f2", expected="f1")
    with pytest.raises(StoreError, match="now points at f2, not at f1"):
        s.set_current("m", "f3", expected="f1")
    assert s.current("m") == "f2"
    assert s.set_current("m", "f2", expected="f1").fingerprint == "f2"   # the same move: done


def test_a_publish_never_undoes_a_rollback_made_while_it_built(tmp_path):
    """kiln ci assessed `m` at f2 and built f3; meanwhile someone rolled back to f1. The
    publish keeps f3 in the store, leaves the rollback current and reports the spec failed;
    a reuse assessed before the rollback does the same."""
    s = PlanStore(tmp_path / "store")
    for i, fp in enumerate(["f1", "f2"]):
        fake_plan(s, "m", fp, f"2025-01-0{i + 1}T00:00:00Z")
        s.set_current("m", fp)
    staging = s.staging_dir("m")
    (staging / "plan").mkdir()
    (staging / "plan" / "engine.pt2").write_bytes(b"y" * 10)
    (staging / "plan" / "plan.json").write_text(json.dumps({
        "name": "m", "fingerprint": "f3", "created_at": "2025-01-03T00:00:00Z",
        "files": {"engine.pt2": {"size": 10, "sha256": "1" * 64}}}))
    s.rollback("m", to="f1")
    log = io.StringIO()
    res = _publish(s, Assessment("m.yaml", BUILD, "changed: spec", name="m", previous="f2"),
                   BuildOutcome(True, str(staging), fingerprint="f3"), keep=1, log=log)
    assert res.status == "failed" and "now points at f1, not at f2" in res.error, log.getvalue()
    assert s.current("m") == "f1" and s.has("f3") and s.has("f2")   # pinned_from f2 stays
    res = _reuse(s, Assessment("m.yaml", REUSE, "in the store", name="m", fingerprint="f3",
                               previous="f2"), log)
    assert res.status == "failed" and s.current("m") == "f1"


def test_the_pointer_records_its_plans_digest(tmp_path):
    """`kiln ci current NAME --digest` prints the sha256 of the current plan's plan.json (what
    `kiln serve --expect-digest` takes); a plan changed since it was made current is refused."""
    from kiln.cli import app

    s = PlanStore(tmp_path / "store")
    fake_plan(s, "m", "f1", "2025-01-01T00:00:00Z")
    digest = hashlib.sha256((s.plan_dir("f1") / "plan.json").read_bytes()).hexdigest()
    assert s.set_current("m", "f1").digest == digest == s.pointer("m").digest
    runner = CliRunner()
    args = ["ci", "current", "m", "--store", str(s.root)]
    assert runner.invoke(app, [*args, "--digest"]).output.strip() == digest
    assert runner.invoke(app, args).output.strip() == str(s.plan_dir("f1"))
    m = json.loads((s.plan_dir("f1") / "plan.json").read_text())
    (s.plan_dir("f1") / "plan.json").write_text(json.dumps({**m, "created_at": "2030"}))
    r = runner.invoke(app, [*args, "--digest"])
    assert r.exit_code == 1 and f"the pointer recorded {digest}" in r.output
