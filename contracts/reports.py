"""What a plan check reports: the accuracy gate's score and `kiln verify`'s report.

    runtime/accuracy_gate.py score() -> GateScore        (the build's gate and verify's re-run)
    runtime/accuracy_gate.py rerun_gate() -> GateRerun   (a GateScore + drift since the build)
    runtime/tools/verify.py verify_plan() -> VerifyReport
        golden: GoldenResult per prompt; agreement: AgreementResult; accuracy: AccuracyResult

Torch-free, stdlib only: kiln ci's plan store keeps each published plan's VerifyReport
(records/<fp>.json, builder/plan_ci/store.py) and reads it back without the runtime. JSON
only at that file boundary: `to_json` writes the keys kiln has always written (a field that
is None where the key used to be absent is left out); `from_json` reads a record of any kiln
leniently (a missing key takes its default, an unknown one is ignored), since a store keeps
the records of older and newer kilns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kiln.contracts.manifest import AccuracyRecord, ManifestError


def _get(d: Any, key: str, kind, default=None):
    """d[key] when d is a dict and the value is of `kind`, else default."""
    v = d.get(key) if isinstance(d, dict) else None
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    return v if isinstance(v, kind) and not (kind is not bool and isinstance(v, bool)) \
        else default


@dataclass(frozen=True)
class GateScore:
    """A plan's next-token scores against its unquantized reference on the evaluation tokens
    (runtime/accuracy_gate.py score)."""
    ppl: float                 # the plan's perplexity
    ref_ppl: float             # the reference's
    ppl_increase: float        # ppl / ref_ppl - 1
    max_ppl_increase: float    # the spec's limit
    top1_agreement: float      # fraction of predictions whose argmax is the reference's
    tokens: int                # predictions scored
    passed: bool               # ppl_increase <= max_ppl_increase

    def describe(self, text: str = "?") -> str:
        """One line for a person (`text`: the evaluation text's name)."""
        return (f"ppl {self.ppl:.3f} vs {self.ref_ppl:.3f} unquantized "
                f"({self.ppl_increase:+.2%}, limit {self.max_ppl_increase:.2%}), top-1 "
                f"agreement {self.top1_agreement:.2%} on {self.tokens} tokens of {text}")


@dataclass(frozen=True)
class GateRerun(GateScore):
    """`kiln verify`'s re-run of the build's accuracy gate on this machine."""
    text: str = ""             # the evaluation text's name
    drift: float = 0.0         # ppl / the build's ppl - 1
    ok: bool = False           # passed, and |drift| within the runtime's tolerance
    summary: str = ""          # for a person

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Optional["GateRerun"]:
        if not isinstance(d, dict):
            return None
        return cls(ppl=_get(d, "ppl", float, 0.0), ref_ppl=_get(d, "ref_ppl", float, 0.0),
                   ppl_increase=_get(d, "ppl_increase", float, 0.0),
                   max_ppl_increase=_get(d, "max_ppl_increase", float, 0.0),
                   top1_agreement=_get(d, "top1_agreement", float, 0.0),
                   tokens=_get(d, "tokens", int, 0), passed=_get(d, "passed", bool, False),
                   text=_get(d, "text", str, ""), drift=_get(d, "drift", float, 0.0),
                   ok=_get(d, "ok", bool, False), summary=_get(d, "summary", str, ""))


@dataclass(frozen=True)
class GoldenResult:
    """One golden prompt's greedy completion and its verdict."""
    prompt: str
    chat: bool                       # sent as one user message (chat template)
    max_tokens: int
    expected: Optional[str]          # the completion the spec requires (None: any)
    text: str                        # what the plan generated
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    error: Optional[str]             # why the request failed, if it did
    key: str                         # GoldenPrompt.key: matches the previous plan's output
    ok: bool

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "token_ids": list(self.token_ids)}

    @classmethod
    def from_json(cls, d: Any) -> "GoldenResult":
        return cls(prompt=_get(d, "prompt", str, ""), chat=_get(d, "chat", bool, False),
                   max_tokens=_get(d, "max_tokens", int, 0),
                   expected=_get(d, "expected", str), text=_get(d, "text", str, ""),
                   token_ids=tuple(_get(d, "token_ids", list, [])),
                   finish_reason=_get(d, "finish_reason", str), error=_get(d, "error", str),
                   key=_get(d, "key", str, ""), ok=_get(d, "ok", bool, False))


@dataclass(frozen=True)
class AgreementResult:
    """Greedy-token agreement with the previous plan of the same spec (golden_agreement)."""
    ok: bool
    minimum: Optional[float]         # the spec's golden_agreement (None: not asked for)
    value: Optional[float]           # None: not measured
    summary: str
    prompts: Optional[int] = None    # prompts compared (when measured)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if self.prompts is None:
            del out["prompts"]
        return out

    @classmethod
    def from_json(cls, d: Any) -> "AgreementResult":
        return cls(ok=_get(d, "ok", bool, True), minimum=_get(d, "minimum", float),
                   value=_get(d, "value", float), summary=_get(d, "summary", str, ""),
                   prompts=_get(d, "prompts", int))


@dataclass(frozen=True)
class AccuracyResult:
    """The accuracy gate as `kiln verify` found it."""
    ok: bool
    applicable: bool                      # the plan recorded a gate
    summary: str
    measured: Optional[AccuracyRecord] = None   # the build's record (plan.json accuracy)
    result: Optional[GateRerun] = None          # the re-run (None: not applicable, or failed)

    def to_json(self) -> dict:
        out: dict = {"ok": self.ok, "applicable": self.applicable, "summary": self.summary}
        if self.measured is not None:
            out["measured"] = self.measured.to_json()
        if self.result is not None:
            out["result"] = self.result.to_json()
        return out

    @classmethod
    def from_json(cls, d: Any) -> "AccuracyResult":
        try:
            measured = AccuracyRecord.from_json(d["measured"], "measured")
        except (KeyError, TypeError, ManifestError):
            measured = None          # an older kiln's record: the summary says it all
        return cls(ok=_get(d, "ok", bool, True), applicable=_get(d, "applicable", bool, False),
                   summary=_get(d, "summary", str, ""), measured=measured,
                   result=GateRerun.from_json(_get(d, "result", dict)))


@dataclass(frozen=True)
class VerifyReport:
    """`kiln verify`'s answer for one plan (runtime/tools/verify.py verify_plan)."""
    ok: bool
    text: str                             # for a person (kiln verify prints it)
    golden: tuple[GoldenResult, ...] = ()
    agreement: Optional[AgreementResult] = None
    accuracy: Optional[AccuracyResult] = None

    def to_json(self) -> dict:
        """The details kiln ci keeps in the store (the text is kept beside them)."""
        out: dict = {"golden": [g.to_json() for g in self.golden]}
        if self.agreement is not None:
            out["agreement"] = self.agreement.to_json()
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy.to_json()
        return out

    @classmethod
    def from_json(cls, d: Any, text: str = "") -> Optional["VerifyReport"]:
        """The report from its stored details (None for something that is not one); ok is
        recomputed from its parts."""
        if not isinstance(d, dict):
            return None
        golden = tuple(GoldenResult.from_json(g) for g in _get(d, "golden", list, [])
                       if isinstance(g, dict))
        agreement = _get(d, "agreement", dict)
        accuracy = _get(d, "accuracy", dict)
        report = cls(False, text, golden,
                     AgreementResult.from_json(agreement) if agreement is not None else None,
                     AccuracyResult.from_json(accuracy) if accuracy is not None else None)
        return dataclasses.replace(report, ok=report.parts_ok)

    @property
    def parts_ok(self) -> bool:
        """Every golden prompt, the agreement and the accuracy gate are ok."""
        return (all(g.ok for g in self.golden)
                and (self.agreement is None or self.agreement.ok)
                and (self.accuracy is None or self.accuracy.ok))
