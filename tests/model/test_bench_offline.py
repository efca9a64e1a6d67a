"""`kiln bench --offline`: the engine runs in the process layout `kiln serve` uses (only the
engine thread computes multi-threaded), and the report says so."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_offline_bench_lays_out_threads_as_serve_does(tiny_plan, tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: every thread computes single-threaded anyway")
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "bench", str(tiny_plan), "--offline",
                        "-c", "1", "-c", "4", "--requests", "4", "--output-len", "8",
                        "--naive-requests", "1", "--threads", "2", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    # before, the main thread kept torch's default (every core) beside the engine's pool
    assert report["compute_threads"] == {"engine": 2, "other": 1}
    assert [e["concurrency"] for e in report["engine"]] == [1, 4]
    assert all(e["output_tokens"] == 4 * 8 for e in report["engine"])
    assert "output_tokens_per_s" in report["naive_hf"] or "skipped" in report["naive_hf"]
