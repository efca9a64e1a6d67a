"""What kiln ci does with each spec, and why: reuse a plan, build one, or report a failure.

    load spec --bad--> fail (the spec's own message)
      | quick key of the current plan matches?  --> reuse "unchanged"       (no torch, no hashing)
      | fingerprint (opens the checkpoint, digests the weights, imports torch)
      |   in the store?  --> reuse (the pointer moves if it was not current)
      |   else           --> build, because: new spec, or which fingerprint input changed
      |                      (spec / weights / toolchain / target), diffed against the
      |                      fingerprint_inputs the current plan's manifest recorded
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kiln.builder.plan_ci.records import InputChange
from kiln.builder.plan_ci.store import PlanStore
from kiln.builder.spec import Spec, SpecError, load_spec
from kiln.builder.uptodate import quick_up_to_date
from kiln.contracts.manifest import DraftRecord, StoredPlan

INPUTS = ("spec", "weights", "toolchain", "target")
REUSE, BUILD, FAIL = "reuse", "build", "fail"


@dataclass
class Assessment:
    """What kiln ci does with one spec, and why."""
    spec_path: Path
    action: str                          # reuse | build | fail
    reason: str                          # one line for a person
    name: Optional[str] = None
    device: Optional[str] = None         # the spec's target.device (CI runner choice)
    fingerprint: Optional[str] = None    # the plan this spec needs now
    previous: Optional[str] = None       # the spec's current plan before this run
    changed: list[InputChange] = field(default_factory=list)   # fingerprint inputs changed
    error: Optional[str] = None
    spec: Optional[Spec] = field(default=None, repr=False)
    draft: Optional[DraftRecord] = None  # the stored plan of the draft spec it names, if any

    def to_json(self) -> dict:
        return {"spec_path": str(self.spec_path), "name": self.name, "device": self.device,
                "action": self.action, "reason": self.reason, "fingerprint": self.fingerprint,
                "previous": self.previous,
                "changed": [dataclasses.asdict(c) for c in self.changed], "error": self.error}


def find_specs(folder: str | os.PathLike) -> list[Path]:
    """The spec files of a folder (*.yaml, *.yml), sorted; a file is taken as is."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def assess(spec_path: Path, store: PlanStore, full: bool = False,
           draft: Optional[DraftRecord] = None) -> Assessment:
    """Decide what to do with one spec. `full`: skip the quick key, compute the fingerprint.
    `draft`: the stored plan of the draft spec the spec names (its path: plans/<fp>)."""
    from kiln.builder.draft import load_draft_spec

    try:
        spec = load_spec(spec_path)
        load_draft_spec(spec, spec_path)   # a draft spec that names a draft, or a cycle
    except SpecError as e:
        return Assessment(spec_path, FAIL, "invalid spec", error=str(e))
    a = Assessment(spec_path, BUILD, "", name=spec.name, device=spec.target.device, spec=spec,
                   draft=draft)
    ptr = store.pointer(spec.name)
    a.previous = ptr.fingerprint if ptr else None
    own = ptr and (ptr.pinned_from or ptr.fingerprint)   # the plan the spec gave last time
    if not full and own and (m := quick_up_to_date(spec, store.plan_dir(own))) \
            and _same_draft(m, draft) \
            and (own == ptr.fingerprint or store.has(ptr.fingerprint)):
        a.action, a.reason, a.fingerprint = REUSE, _unchanged(ptr), ptr.fingerprint
        return a

    fp, inputs, error = _fingerprint(spec, spec_path, draft)
    if error:
        a.action, a.reason, a.error = FAIL, "cannot fingerprint", error
        return a
    a.fingerprint = fp
    prev_manifest = store.manifest(own) if own else None
    a.changed = diff_inputs(prev_manifest, inputs, spec) if prev_manifest else []
    if fp == own and store.has(ptr.fingerprint):
        a.action, a.reason, a.fingerprint = REUSE, _unchanged(ptr), ptr.fingerprint
    elif store.has(fp):
        a.action = REUSE
        a.reason = f"plan {fp[:12]} is already in the store; the pointer moves to it"
    elif a.previous is None:
        a.reason = "new spec (no current plan)"
    elif prev_manifest is None:
        a.reason = f"the current plan {a.previous[:12]} is missing from the store"
    else:
        a.reason = "changed: " + ", ".join(c.input for c in a.changed) if a.changed \
            else "fingerprint changed"
    return a


def _unchanged(ptr) -> str:
    if ptr.pinned_from:
        return (f"unchanged; rolled back to {ptr.fingerprint[:12]} (kiln ci rollback), which "
                f"stays current until the spec's inputs change from {ptr.pinned_from[:12]}")
    return "unchanged"


def _same_draft(manifest, draft: Optional[DraftRecord]) -> bool:
    """Whether a plan was built against this stored draft plan (True: no draft spec)."""
    if draft is None:
        return True
    recorded = manifest.speculative.draft if manifest.speculative else None
    return recorded is not None and recorded.fingerprint == draft.fingerprint


def _fingerprint(spec: Spec, spec_path: Path, draft: Optional[DraftRecord] = None
                 ) -> tuple[Optional[str], Optional[dict], Optional[str]]:
    """(fingerprint, inputs, None) or (None, None, message), as the build computes them (a
    draft plan's fingerprint included: `draft`, else the plan draft_plan names). Imports
    torch."""
    from kiln.builder.build import check_spec_against_model, plan_fingerprint
    from kiln.builder.draft import draft_now
    from kiln.builder.sources import CheckpointError, open_checkpoint

    try:
        ckpt = open_checkpoint(spec.model)
        check_spec_against_model(spec, ckpt.config)
        fp, inputs = plan_fingerprint(spec, ckpt, draft=draft or draft_now(spec, spec_path))
    except (SpecError, CheckpointError) as e:
        return None, None, str(e)
    except Exception as e:  # an unreadable checkpoint can fail in many ways
        return None, None, f"{type(e).__name__}: {e}"
    return fp, inputs, None


def diff_inputs(prev_manifest: StoredPlan, inputs: dict, spec: Spec) -> list[InputChange]:
    """Which fingerprint inputs differ from the ones the previous plan was built from."""
    old = prev_manifest.fingerprint_inputs
    out = []
    for key in INPUTS:
        if old.get(key) == inputs.get(key):
            continue
        if key == "spec":
            detail = _diff_values(prev_manifest.spec, spec.canonical())
        elif key == "weights":
            detail = f"sha256 {_short(old.get(key))} -> {_short(inputs.get(key))}"
        else:
            detail = _diff_values(old.get(key) or {}, inputs.get(key) or {})
        out.append(InputChange(key, detail or "changed"))
    return out


def _short(v: Any) -> str:
    return str(v)[:12] if v else "(none)"


_UNSET = object()


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Append "path: old -> new" for every leaf where a and b differ."""
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _diff(a.get(k, _UNSET), b.get(k, _UNSET), f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i in range(max(len(a), len(b))):
            _diff(a[i] if i < len(a) else _UNSET, b[i] if i < len(b) else _UNSET,
                  f"{path}[{i}]", out)
    else:
        out.append(f"{path}: {_fmt(a)} -> {_fmt(b)}")


def _diff_values(old: dict, new: dict, most: int = 4) -> str:
    parts: list[str] = []
    _diff(old, new, "", parts)
    more = f"; and {len(parts) - most} more" if len(parts) > most else ""
    return "; ".join(parts[:most]) + more


def _fmt(v: Any) -> str:
    if v is _UNSET:
        return "(unset)"
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."
