"""The typed data of a kiln ci run that crosses a process or file boundary.

    assess -> InputChange (which fingerprint input changed, and how)
    build worker --BuildOutcome (pickled)--> the parent, which publishes the plan
    store/records/<fp>.json <-> PlanRecord (to_json / from_json, nowhere else)

Torch-free, like the rest of plan_ci's module level. A record is read leniently (a missing
key takes its default): a store keeps the records of older and newer kilns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kiln.contracts.manifest import AccuracyRecord
from kiln.contracts.reports import VerifyReport


@dataclass(frozen=True)
class InputChange:
    """A fingerprint input that differs from the one the previous plan was built from."""
    input: str        # spec | weights | toolchain | target
    detail: str       # for a person: "limits.max_batch_size: 4 -> 3", "sha256 ab.. -> cd.."

    @classmethod
    def from_json(cls, d: Any) -> Optional["InputChange"]:
        if not isinstance(d, dict) or not isinstance(d.get("input"), str):
            return None
        return cls(d["input"], str(d.get("detail", "")))


def changes_from_json(items: Any) -> tuple[InputChange, ...]:
    return tuple(c for c in map(InputChange.from_json, items or ()) if c is not None) \
        if isinstance(items, list) else ()


@dataclass(frozen=True)
class BuildOutcome:
    """What build_and_verify did with one spec (in a worker process, or this one)."""
    ok: bool
    staging: Optional[str]                     # the staging directory (None: the worker died)
    error: Optional[str] = None                # why it failed
    fingerprint: Optional[str] = None
    build_seconds: Optional[float] = None
    plan_bytes: Optional[int] = None
    measured_accuracy: Optional[AccuracyRecord] = None   # the build's accuracy gate
    verify_seconds: Optional[float] = None
    verify_text: Optional[str] = None          # kiln verify's text
    verify: Optional[VerifyReport] = None


@dataclass(frozen=True)
class PlanRecord:
    """store/records/<fp>.json: what kiln ci learnt building and verifying a published plan
    (its golden outputs are the reference of the spec's next plan)."""
    name: Optional[str] = None
    spec_path: Optional[str] = None
    reason: Optional[str] = None               # why it was built
    changed: tuple[InputChange, ...] = ()
    previous: Optional[str] = None             # the spec's current plan before it
    build_seconds: Optional[float] = None
    verify: Optional[VerifyReport] = None
    verify_text: Optional[str] = None
    published_at: float = 0.0                  # time.time() when it entered the store

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["changed"] = [dataclasses.asdict(c) for c in self.changed]
        out["verify"] = self.verify.to_json() if self.verify is not None else None
        return out

    @classmethod
    def from_json(cls, d: Any) -> Optional["PlanRecord"]:
        """None for something that is not a record at all."""
        if not isinstance(d, dict):
            return None

        def get(key, kind, default=None):
            v = d.get(key)
            return v if isinstance(v, kind) and not isinstance(v, bool) else default
        seconds = get("build_seconds", (int, float))
        return cls(name=get("name", str), spec_path=get("spec_path", str),
                   reason=get("reason", str), changed=changes_from_json(d.get("changed")),
                   previous=get("previous", str),
                   build_seconds=float(seconds) if seconds is not None else None,
                   verify=VerifyReport.from_json(d.get("verify"), get("verify_text", str, "")),
                   verify_text=get("verify_text", str),
                   published_at=float(get("published_at", (int, float), 0.0)))
