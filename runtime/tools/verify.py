"""`kiln verify`: does a plan run here, and does it still say what it said?

    load_plan (format, target, toolchain, checksums)      -- the caller, before verify_plan
    -> generate greedily from the spec's golden prompts   (or one default prompt)
       -> expected completion given?        exact match, else DRIFT (expected vs got)
       -> spec.golden_agreement + reference? token agreement with the previous plan
    -> accuracy gate: runtime/accuracy_gate.py rerun_gate(plan) when the plan recorded one
    -> VerifyReport (kiln.contracts.reports; kiln ci keeps it in its store)

The runtime never imports the builder: everything comes from the plan's manifest
(`PlanManifest.golden`, `.golden_agreement`, `.accuracy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.contracts.manifest import GoldenPrompt, PlanManifest
from kiln.contracts.reports import AccuracyResult, AgreementResult, GoldenResult, VerifyReport
from kiln.runtime.plan import Plan

DEFAULT_PROMPT = "The quick brown fox"
DEFAULT_MAX_TOKENS = 8


@dataclass(frozen=True)
class GoldenOutput:
    """A golden prompt's greedy completion (or why there is none)."""
    prompt: GoldenPrompt
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    error: Optional[str]           # the request failed: why


def golden_prompts(golden: tuple[GoldenPrompt, ...]) -> list[GoldenPrompt]:
    """The spec's golden prompts (PlanManifest.golden), or the default smoke prompt (no
    expected text)."""
    if golden:
        return list(golden)
    return [GoldenPrompt(DEFAULT_PROMPT, chat=False, max_tokens=DEFAULT_MAX_TOKENS,
                         expected=None, default=True)]


def run_golden(plan: Plan, prompts: list[GoldenPrompt]) -> list[GoldenOutput]:
    """Greedy completions for `prompts`, in order."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    outs = []
    with Engine.from_plan(plan) as engine:
        for g in prompts:
            try:
                request = [{"role": "user", "content": g.prompt}] if g.chat else g.prompt
                res = engine.submit(request, SamplingParams(max_tokens=g.max_tokens,
                                                            temperature=0.0)).result()
                out = GoldenOutput(g, res.text, tuple(res.token_ids), res.finish_reason,
                                   res.error)
            except Exception as e:  # a refused request fails this prompt, not the others
                out = GoldenOutput(g, "", (), "error", f"{type(e).__name__}: {e}")
            outs.append(out)
    return outs


def token_agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of token positions where two plans' greedy outputs agree.

    Per prompt: equal tokens at the same position, over the longer of the two outputs; a
    divergence usually changes everything after it, which this counts (it is meant to)."""
    same = total = 0
    for a, b in zip(got, ref):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
    return same / total if total else 1.0


def verify_plan(plan: Plan, reference: Optional[dict[str, list[int]]] = None) -> VerifyReport:
    """Generate from the plan's golden prompts and re-run its accuracy gate.

    `reference`: GoldenPrompt.key -> token ids from the previous plan of the same spec (kiln
    ci keeps them); needed only when the spec sets `golden_agreement`.
    """
    lines = [f"plan {plan.path} ({plan.name}, fingerprint {plan.fingerprint[:16]}): "
             "loads here (format, target, toolchain, checksums)"]
    outs = run_golden(plan, golden_prompts(plan.manifest.golden))
    golden = []
    for i, out in enumerate(outs, 1):
        result, report_lines = _judge(out, "default prompt" if out.prompt.default
                                      else f"golden {i}/{len(outs)}")
        golden.append(result)
        lines += report_lines

    agreement = _agreement(plan.manifest, outs, reference)
    lines.append(f"token agreement with the previous plan: {agreement.summary}")
    accuracy = _accuracy(plan)
    lines.append(f"accuracy: {accuracy.summary}")
    ok = all(g.ok for g in golden) and agreement.ok and accuracy.ok
    lines.append("result: " + ("ok" if ok else "FAILED"))
    return VerifyReport(ok, "\n".join(lines), tuple(golden), agreement, accuracy)


def _judge(out: GoldenOutput, label: str) -> tuple[GoldenResult, list[str]]:
    """One golden prompt's verdict, and its lines of the report's text."""
    g, n = out.prompt, len(out.token_ids)
    if out.error:
        status, good = f"ERROR: {out.error}", False
    elif n == 0:
        status, good = "ERROR: generated no tokens", False
    elif g.expected is not None and out.text != g.expected:
        status, good = "DRIFT", False
    else:
        status = f"ok ({n} tokens" + (", matches expected)" if g.expected is not None else ")")
        good = True
    lines = [f"{label} {g.prompt!r}{' (chat)' if g.chat else ''}: {status}"]
    if status == "DRIFT":
        lines.append(f"  expected: {g.expected!r}")
        lines.append(f"  got:      {out.text!r}")
    return GoldenResult(prompt=g.prompt, chat=g.chat, max_tokens=g.max_tokens,
                        expected=g.expected, text=out.text, token_ids=out.token_ids,
                        finish_reason=out.finish_reason, error=out.error, key=g.key,
                        ok=good), lines


def _agreement(manifest: PlanManifest, outs: list[GoldenOutput],
               reference: Optional[dict[str, list[int]]]) -> AgreementResult:
    minimum = manifest.golden_agreement
    if minimum is None:
        return AgreementResult(True, None, None,
                               "not applicable (spec sets no golden_agreement)")
    pairs = [(list(o.token_ids), reference[o.prompt.key]) for o in outs
             if reference and o.prompt.key in reference]
    if not pairs:
        return AgreementResult(True, minimum, None,
                               "not measured (no previous plan output for these prompts)")
    value = token_agreement([a for a, _ in pairs], [b for _, b in pairs])
    good = value >= minimum
    return AgreementResult(good, minimum, value,
                           f"{value:.3f} over {len(pairs)} prompt(s), minimum {minimum:.3f}"
                           + ("" if good else " -- DRIFT"), prompts=len(pairs))


def _accuracy(plan: Plan) -> AccuracyResult:
    """The quantization accuracy gate, re-run here (runtime/accuracy_gate.py)."""
    measured = plan.manifest.accuracy
    if measured is None:
        return AccuracyResult(True, False, "not applicable (the plan has no accuracy gate)")
    from kiln.runtime.accuracy_gate import rerun_gate

    try:
        result = rerun_gate(plan)
    except Exception as e:   # an error it cannot judge fails the gate, with its message
        return AccuracyResult(False, True, f"ERROR re-running the gate: {type(e).__name__}: {e}",
                              measured)
    return AccuracyResult(result.ok, True, ("passed: " if result.ok else "FAILED: ")
                          + result.summary, measured, result)
