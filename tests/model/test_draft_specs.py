"""speculative.draft_plan naming a spec file: `kiln build` builds the draft spec's plan at its
default output first (or finds it up to date), and kiln ci builds the draft spec before the
specs that name it, drafting with its plan in the store; a failed draft spec fails them."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.builder.build import build
from kiln.builder.plan_ci.assess import find_specs
from kiln.builder.plan_ci.pipeline import CIOptions, order_drafts_first, rebuild
from kiln.builder.plan_ci.store import PlanStore
from kiln.builder.progress import Progress
from kiln.runtime.plan import read_manifest
from tests.model.test_ci import by_name, spec_text

pytestmark = pytest.mark.model

QUIET = Progress(enabled=False)
SPECULATIVE = """speculative:
  method: draft
  draft_plan: {draft}
  max_draft_tokens: 4
  max_batch: 4
"""


def _specs(d: Path, draft_stem: str = "z-draft", target_stem: str = "a-target") -> Path:
    """A draft spec and a target that names it (the target sorts first)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{draft_stem}.yaml").write_text(spec_text("tiny-draft", "random"))
    target = d / f"{target_stem}.yaml"
    target.write_text(spec_text("tiny-target", "random",
                                extra=SPECULATIVE.format(draft=f"{draft_stem}.yaml")))
    return target


def test_build_builds_the_draft_spec_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = _specs(tmp_path / "specs")
    res = build(target, progress=QUIET)
    draft_plan = tmp_path / "plans" / "tiny-draft"
    assert res.rebuilt and res.path == Path("plans/tiny-target")
    rec = res.manifest.speculative.draft
    assert (rec.name, rec.fingerprint) == ("tiny-draft", read_manifest(draft_plan).fingerprint)
    assert (res.path / rec.path).resolve() == draft_plan.resolve()
    again = build(target, progress=QUIET)       # both up to date: nothing rebuilt
    assert not again.rebuilt and read_manifest(draft_plan).fingerprint == rec.fingerprint


def test_ci_builds_the_draft_spec_before_its_target(tmp_path):
    specs = tmp_path / "model_specs"
    target = _specs(specs)
    paths = find_specs(specs)
    assert [p.name for p in order_drafts_first(paths)] == ["z-draft.yaml", "a-target.yaml"]
    store = PlanStore(tmp_path / "store")
    first = by_name(rebuild(paths, CIOptions(store=store.root)))
    assert {n: s.status for n, s in first.items()} == {"tiny-draft": "rebuilt",
                                                        "tiny-target": "rebuilt"}, first
    t_dir = store.plan_dir(first["tiny-target"].fingerprint)
    rec = read_manifest(t_dir).speculative.draft
    assert rec.fingerprint == first["tiny-draft"].fingerprint
    assert (t_dir / rec.path).resolve() == store.plan_dir(rec.fingerprint).resolve()
    assert not list(store.staging.iterdir())
    second = by_name(rebuild(paths, CIOptions(store=store.root)))
    assert {s.status for s in second.values()} == {"reused"}, second

    (specs / "z-draft.yaml").write_text(spec_text("tiny-draft", "random") + "bogus: 1\n")
    (specs / "a-target.yaml").write_text(target.read_text().replace("max_tokens: 6",
                                                                     "max_tokens: 5"))
    third = rebuild(paths, CIOptions(store=store.root))
    failed = {s.name or Path(s.spec_path).stem: s for s in third.specs}
    assert failed["tiny-target"].status == "failed"
    assert failed["tiny-target"].reason == "draft spec failed"
    assert "z-draft.yaml" in failed["tiny-target"].error, failed["tiny-target"].error
    assert store.current("tiny-target") == first["tiny-target"].fingerprint
