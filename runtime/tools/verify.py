"""`kiln verify`: does a plan run here, and does it still say what it said?

    load_plan (format, target, toolchain, checksums)      -- the caller, before verify_plan
    -> generate greedily from the spec's golden prompts   (or one default prompt)
       -> expected completion given?        exact match, else DRIFT (expected vs got)
       -> spec.golden_agreement + reference? token agreement with the previous plan
    -> accuracy gate: runtime.accuracy.rerun_gate(plan) when the plan recorded one

The runtime never imports the builder: everything comes from the plan's manifest
(`PlanManifest.golden`, `.golden_agreement`, `.accuracy`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.contracts.manifest import PlanManifest
from kiln.runtime.plan import Plan

DEFAULT_PROMPT = "The quick brown fox"
DEFAULT_MAX_TOKENS = 8


@dataclass
class VerifyReport:
    ok: bool
    text: str                          # for a person (kiln verify prints it)
    details: dict = field(default_factory=dict)   # golden, agreement, accuracy (JSON-able)


def golden_key(g: dict) -> str:
    """How a golden prompt is matched with the same prompt's output from another plan."""
    return f"{'chat' if g.get('chat') else 'text'}|{g.get('max_tokens')}|{g['prompt']}"


def golden_prompts(golden: list[dict]) -> list[dict]:
    """The spec's golden prompts (PlanManifest.golden), or the default smoke prompt (no
    expected text)."""
    if golden:
        return [{"prompt": g["prompt"], "chat": bool(g.get("chat")),
                 "max_tokens": int(g.get("max_tokens") or 16), "expected": g.get("expected")}
                for g in golden]
    return [{"prompt": DEFAULT_PROMPT, "chat": False, "max_tokens": DEFAULT_MAX_TOKENS,
             "expected": None, "default": True}]


def run_golden(plan: Plan, prompts: list[dict]) -> list[dict]:
    """Greedy completions for `prompts` (each gets text, token_ids, finish_reason, error)."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    outs = []
    with Engine.from_plan(plan) as engine:
        for g in prompts:
            out = dict(g)
            try:
                request = [{"role": "user", "content": g["prompt"]}] if g["chat"] else g["prompt"]
                res = engine.submit(request, SamplingParams(max_tokens=g["max_tokens"],
                                                            temperature=0.0)).result()
                out.update(text=res.text, token_ids=list(res.token_ids),
                           finish_reason=res.finish_reason, error=res.error)
            except Exception as e:  # a refused request fails this prompt, not the others
                out.update(text="", token_ids=[], finish_reason="error",
                           error=f"{type(e).__name__}: {e}")
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

    `reference`: golden_key -> token ids from the previous plan of the same spec (kiln ci
    keeps them); needed only when the spec sets `golden_agreement`.
    """
    lines = [f"plan {plan.path} ({plan.name}, fingerprint {plan.fingerprint[:16]}): "
             "loads here (format, target, toolchain, checksums)"]
    ok = True
    outs = run_golden(plan, golden_prompts(plan.manifest.golden))
    golden_rows = []
    for i, g in enumerate(outs, 1):
        label = "default prompt" if g.get("default") else f"golden {i}/{len(outs)}"
        n = len(g["token_ids"])
        if g["error"]:
            status, good = f"ERROR: {g['error']}", False
        elif n == 0:
            status, good = "ERROR: generated no tokens", False
        elif g["expected"] is not None and g["text"] != g["expected"]:
            status, good = "DRIFT", False
        else:
            status = f"ok ({n} tokens" + (", matches expected)" if g["expected"] is not None
                                          else ")")
            good = True
        ok &= good
        lines.append(f"{label} {g['prompt']!r}{' (chat)' if g['chat'] else ''}: {status}")
        if status == "DRIFT":
            lines.append(f"  expected: {g['expected']!r}")
            lines.append(f"  got:      {g['text']!r}")
        golden_rows.append({**{k: g.get(k) for k in ("prompt", "chat", "max_tokens", "expected",
                                                     "text", "token_ids", "finish_reason",
                                                     "error")}, "key": golden_key(g),
                            "ok": good})

    agreement = _agreement(plan.manifest, outs, reference)
    ok &= agreement["ok"]
    lines.append(f"token agreement with the previous plan: {agreement['summary']}")

    accuracy = _accuracy(plan)
    ok &= accuracy["ok"]
    lines.append(f"accuracy: {accuracy['summary']}")
    lines.append("result: " + ("ok" if ok else "FAILED"))
    return VerifyReport(ok, "\n".join(lines),
                        {"golden": golden_rows, "agreement": agreement, "accuracy": accuracy})


def _agreement(manifest: PlanManifest, outs: list[dict], reference) -> dict:
    minimum = manifest.golden_agreement
    if minimum is None:
        return {"ok": True, "minimum": None, "value": None,
                "summary": "not applicable (spec sets no golden_agreement)"}
    pairs = [(g["token_ids"], reference[golden_key(g)]) for g in outs
             if reference and golden_key(g) in reference]
    if not pairs:
        return {"ok": True, "minimum": minimum, "value": None,
                "summary": "not measured (no previous plan output for these prompts)"}
    value = token_agreement([a for a, _ in pairs], [b for _, b in pairs])
    good = value >= minimum
    return {"ok": good, "minimum": minimum, "value": value, "prompts": len(pairs),
            "summary": f"{value:.3f} over {len(pairs)} prompt(s), minimum {minimum:.3f}"
                       + ("" if good else " -- DRIFT")}


def _accuracy(plan: Plan) -> dict:
    """The hook for the quantization accuracy gate (runtime.accuracy, when installed).

    Contract: `runtime.accuracy.rerun_gate(plan)` returns an object or dict with `ok`
    (bool) and optionally `summary` (str); it raises on an error it cannot judge."""
    if plan.manifest.accuracy is None:
        return {"ok": True, "applicable": False,
                "summary": "not applicable (the plan has no accuracy gate)"}
    measured = plan.manifest.accuracy.to_json()
    if importlib.util.find_spec("kiln.runtime.accuracy") is None:
        return {"ok": True, "applicable": False, "measured": measured,
                "summary": "not re-run (runtime.accuracy is not available); measured at "
                           f"build: {measured}"}
    from kiln.runtime import accuracy as acc

    try:
        result = acc.rerun_gate(plan)
    except Exception as e:
        return {"ok": False, "applicable": True, "measured": measured,
                "summary": f"ERROR re-running the gate: {type(e).__name__}: {e}"}
    data = _as_dict(result)
    good = data.get("ok", data.get("passed"))
    if not isinstance(good, bool):
        return {"ok": False, "applicable": True, "measured": measured, "result": data,
                "summary": f"FAILED: rerun_gate returned no ok/passed flag ({result!r})"}
    summary = data.get("summary") or data.get("text") or str(result)
    return {"ok": good, "applicable": True, "measured": measured, "result": data,
            "summary": ("passed: " if good else "FAILED: ") + str(summary)}


def _as_dict(result: Any) -> dict:
    if isinstance(result, bool):
        return {"ok": result}
    if isinstance(result, dict):
        return dict(result)
    if dataclasses.is_dataclass(result):
        return dataclasses.asdict(result)
    return {k: getattr(result, k) for k in ("ok", "passed", "summary", "text")
            if hasattr(result, k)}
