"""The kiln ci report: one SpecResult per spec, rendered as markdown (for a pull request)
and as JSON (for machines). Pure data and strings: no torch, no store access."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from kiln.builder.plan_ci.records import InputChange

REBUILT, REUSED, FAILED = "rebuilt", "reused", "failed"


@dataclass
class SpecResult:
    """One spec's line of the kiln ci report."""
    spec_path: str
    status: str                              # rebuilt | reused | failed
    reason: str                              # why it was rebuilt / reused / what failed
    name: Optional[str] = None
    device: Optional[str] = None
    fingerprint: Optional[str] = None        # the current plan after this run
    previous: Optional[str] = None           # the current plan before this run
    changed: list[InputChange] = field(default_factory=list)   # fingerprint inputs changed
    build_seconds: Optional[float] = None
    verify_seconds: Optional[float] = None
    plan_bytes: Optional[int] = None
    accuracy: Optional[str] = None           # the accuracy gate, in words
    verify: Optional[str] = None             # the verify result, in one line
    verify_text: Optional[str] = None        # kiln verify's full text
    error: Optional[str] = None              # why it failed

    @property
    def ok(self) -> bool:
        return self.status != FAILED


@dataclass
class RunReport:
    """The kiln ci rebuild run: to_json is `kiln ci rebuild --json`'s file."""
    specs: list[SpecResult]
    store: str
    seconds: float
    started_at: str
    toolchain: dict = field(default_factory=dict)
    target: Optional[str] = None             # only specs of this device were considered

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.specs)

    def counts(self) -> dict[str, int]:
        return {k: sum(s.status == k for s in self.specs) for k in (REBUILT, REUSED, FAILED)}

    def to_json(self) -> dict:
        return {"ok": self.ok, "store": self.store, "seconds": round(self.seconds, 3),
                "started_at": self.started_at, "toolchain": self.toolchain,
                "target": self.target, "counts": self.counts(),
                "specs": [dataclasses.asdict(s) for s in self.specs]}


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _cell(text: Optional[str]) -> str:
    """Text safe inside a markdown table cell."""
    if not text:
        return "-"
    return " ".join(str(text).split()).replace("|", "\\|")


def _why(s: SpecResult) -> str:
    if s.status == FAILED:
        first = (s.error or s.reason).strip().splitlines()[0] if (s.error or s.reason) else ""
        return first
    if s.changed:
        return "; ".join(f"**{c.input}**: {c.detail}" for c in s.changed)
    return s.reason


def _fp(s: SpecResult) -> str:
    if not s.fingerprint:
        return "-" if not s.previous else f"kept `{s.previous[:12]}`"
    if s.previous and s.previous != s.fingerprint:
        return f"`{s.fingerprint[:12]}` (was `{s.previous[:12]}`)"
    return f"`{s.fingerprint[:12]}`"


def render_markdown(report: RunReport) -> str:
    """The summary a CI job posts on a pull request."""
    c = report.counts()
    verdict = "all plans current" if report.ok else f"{c[FAILED]} failed"
    target = f" (target {report.target})" if report.target else ""
    lines = [f"## Kiln plans{target}: {verdict}", "",
             f"{len(report.specs)} specs: {c[REBUILT]} rebuilt, {c[REUSED]} reused, "
             f"{c[FAILED]} failed in {report.seconds:.1f} s"
             + (f" (kiln {report.toolchain.get('kiln')}, torch {report.toolchain.get('torch')})"
                if report.toolchain else ""), ""]
    if report.specs:
        lines += ["| spec | result | why | plan | build | size | accuracy | verify |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in report.specs:
            status = {FAILED: "**FAILED**"}.get(s.status, s.status)
            build = f"{s.build_seconds:.1f} s" if s.build_seconds is not None else "-"
            lines.append("| " + " | ".join([
                _cell(s.name or s.spec_path), status, _cell(_why(s)), _fp(s), build,
                human_bytes(s.plan_bytes), _cell(s.accuracy), _cell(s.verify)]) + " |")
    failed = [s for s in report.specs if s.status == FAILED]
    if failed:
        lines += ["", "### Failures", ""]
        for s in failed:
            kept = (f"; the current plan stays `{s.previous[:12]}`" if s.previous
                    else "; no plan is published")
            lines += [f"**{s.name or s.spec_path}** (`{s.spec_path}`){kept}", "", "```",
                      (s.error or s.verify_text or s.reason).rstrip(), "```", ""]
    verified = [s for s in report.specs if s.verify_text and s.status != FAILED]
    if verified:
        lines += ["", "<details><summary>verify output</summary>", ""]
        for s in verified:
            lines += [f"**{s.name}**", "", "```", s.verify_text.rstrip(), "```", ""]
        lines += ["</details>"]
    return "\n".join(lines).rstrip() + "\n"
