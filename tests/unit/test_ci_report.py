"""kiln ci report rendering: markdown for a pull request, JSON for machines (no model)."""
from __future__ import annotations

import json

import pytest

from kiln.builder.plan_ci.records import InputChange
from kiln.builder.plan_ci.report import RunReport, SpecResult, human_bytes, render_markdown

pytestmark = pytest.mark.unit

FP1, FP2, FP3 = "a" * 64, "b" * 64, "c" * 64


def sample() -> RunReport:
    return RunReport(specs=[
        SpecResult("model_specs/a.yaml", "rebuilt", "changed: spec, weights", name="a",
                   device="cpu", fingerprint=FP2, previous=FP1,
                   changed=[InputChange("spec", "limits.max_seq_len: 256 -> 128"),
                            InputChange("weights", "sha256 111111111111 -> 222222222222")],
                   build_seconds=12.34, verify_seconds=1.0, plan_bytes=3 * 2**20,
                   accuracy="not applicable (the plan has no accuracy gate)",
                   verify="ok: golden 2/2", verify_text="golden 1/2 'hi': ok\nresult: ok"),
        SpecResult("model_specs/b.yaml", "reused", "unchanged", name="b", device="cpu",
                   fingerprint=FP3, plan_bytes=2048, verify="verified when published"),
        SpecResult("model_specs/c.yaml", "failed", "invalid spec",
                   error="invalid spec model_specs/c.yaml:\n  limits.max_batch_size: bad | value"),
        SpecResult("model_specs/d.yaml", "failed", "changed: spec", name="d", previous=FP1,
                   error="verification failed:\ngolden 1/1 'x': DRIFT\n  expected: 'a'\n  got: 'b'"),
    ], store="kiln-store", seconds=20.5, started_at="2025-01-01T00:00:00Z",
        toolchain={"kiln": "0.1.0", "torch": "2.13.0"})


def test_markdown_summary_and_table():
    md = render_markdown(sample())
    assert md.startswith("## Kiln plans: 2 failed\n")
    assert "4 specs: 1 rebuilt, 1 reused, 2 failed in 20.5 s (kiln 0.1.0, torch 2.13.0)" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| spec | result | why | plan | build | size |")
    a, b, c, d = rows[2:6]
    assert "| a | rebuilt |" in a and "**spec**: limits.max_seq_len: 256 -> 128" in a
    assert "**weights**: sha256 111111111111 -> 222222222222" in a
    assert f"`{FP2[:12]}` (was `{FP1[:12]}`)" in a and "12.3 s" in a and "3.0 MiB" in a
    assert "| b | reused | unchanged |" in b and "2.0 KiB" in b
    assert "| model_specs/c.yaml | **FAILED** | invalid spec model_specs/c.yaml: |" in c
    assert f"kept `{FP1[:12]}`" in d
    for row in rows:       # every row has the header's columns ("|" in text is escaped)
        assert row.replace("\\|", "").count("|") == 9


def test_failures_section_keeps_the_whole_message():
    md = render_markdown(sample())
    fail = md.split("### Failures", 1)[1]
    assert "limits.max_batch_size: bad | value" in fail          # verbatim in a code block
    assert f"the current plan stays `{FP1[:12]}`" in fail
    assert "no plan is published" in fail
    assert "expected: 'a'" in fail and "got: 'b'" in fail
    assert "<details><summary>verify output</summary>" in md and "result: ok" in md


def test_all_good_report():
    r = sample()
    r.specs = r.specs[:2]
    md = render_markdown(r)
    assert md.startswith("## Kiln plans: all plans current") and "### Failures" not in md
    assert r.ok


def test_json_report_round_trips():
    r = sample()
    data = json.loads(json.dumps(r.to_json()))
    assert data["ok"] is False and data["counts"] == {"rebuilt": 1, "reused": 1, "failed": 2}
    assert [s["status"] for s in data["specs"]] == ["rebuilt", "reused", "failed", "failed"]
    assert data["specs"][0]["changed"][0] == {"input": "spec",
                                              "detail": "limits.max_seq_len: 256 -> 128"}
    assert data["specs"][2]["error"].startswith("invalid spec")


def test_human_bytes():
    assert [human_bytes(n) for n in (None, 10, 2048, 5 * 2**30)] == ["-", "10 B", "2.0 KiB",
                                                                     "5.0 GiB"]
