"""The typed reports past plan.json read the JSON kiln has always written: kiln verify's report
as kiln ci's store keeps it, and the store's plan records (no model)."""
from __future__ import annotations

import copy
import json

import pytest

from kiln.builder.plan_ci.records import InputChange, PlanRecord
from kiln.builder.plan_ci.store import PlanStore
from kiln.contracts.reports import GateRerun, VerifyReport

pytestmark = pytest.mark.unit

MEASURED = {"ppl": 10.5, "ref_ppl": 10.0, "ppl_increase": 0.05, "max_ppl_increase": 0.15,
            "top1_agreement": 0.9, "tokens": 504, "passed": True, "text": "pydoc",
            "text_sha256": "t" * 64, "eval_tokens": 512, "ids_sha256": "i" * 64, "window": 64,
            "method": "windows of 64 tokens, each a fresh sequence",
            "reference": "eager fp32 model of the same checkpoint",
            "reference_top1": "accuracy/reference_top1.bin", "reference_cached": False}
RESULT = {**{k: MEASURED[k] for k in ("ppl", "ref_ppl", "ppl_increase", "max_ppl_increase",
                                      "top1_agreement", "tokens", "passed", "text")},
          "drift": 0.0, "ok": True, "summary": "ppl 10.500 vs 10.000 unquantized"}
DETAILS = {   # verify details as kiln ci has stored them
    "golden": [{"prompt": "hi", "chat": True, "max_tokens": 3, "expected": None,
                "text": "a b", "token_ids": [5, 6, 7], "finish_reason": "length",
                "error": None, "key": "chat|3|hi", "ok": True}],
    "agreement": {"ok": True, "minimum": 0.9, "value": 1.0, "prompts": 1,
                  "summary": "1.000 over 1 prompt(s), minimum 0.900"},
    "accuracy": {"ok": True, "applicable": True, "measured": MEASURED, "result": RESULT,
                 "summary": "passed: ppl 10.500 vs 10.000 unquantized"},
}


def test_verify_details_round_trip_with_the_same_keys():
    report = VerifyReport.from_json(copy.deepcopy(DETAILS), "text")
    assert report.ok and report.text == "text"
    assert report.golden[0].token_ids == (5, 6, 7) and report.golden[0].key == "chat|3|hi"
    assert report.accuracy.measured.ppl == 10.5 and report.accuracy.result.drift == 0.0
    assert json.loads(json.dumps(report.to_json())) == DETAILS
    # the shapes written when a part does not apply
    bare = {"golden": [], "agreement": {"ok": True, "minimum": None, "value": None,
                                        "summary": "not applicable"},
            "accuracy": {"ok": True, "applicable": False, "summary": "not applicable"}}
    assert VerifyReport.from_json(copy.deepcopy(bare)).to_json() == bare
    failed = copy.deepcopy(DETAILS)
    failed["golden"][0]["ok"] = False
    assert not VerifyReport.from_json(failed).ok
    assert GateRerun.from_json(RESULT).to_json() == RESULT


def test_store_reads_an_old_record_and_writes_the_same_keys(tmp_path):
    store = PlanStore(tmp_path)
    old = {"name": "m", "spec_path": "specs/m.yaml", "reason": "changed: spec",
           "changed": [{"input": "spec", "detail": "limits.max_batch_size: 4 -> 3"}],
           "previous": "p" * 64, "build_seconds": 12, "verify": DETAILS,
           "verify_text": "result: ok", "published_at": 1.5}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "f1.json").write_text(json.dumps(old))
    rec = store.record("f1")
    assert rec.changed == (InputChange("spec", "limits.max_batch_size: 4 -> 3"),)
    assert rec.build_seconds == 12.0 and rec.published_at == 1.5
    assert rec.verify.golden[0].text == "a b" and rec.verify.text == "result: ok"
    assert rec.to_json() == old
    assert PlanRecord.from_json([]) is None and store.record("nope") is None
