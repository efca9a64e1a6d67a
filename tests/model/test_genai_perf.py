"""NVIDIA genai-perf (perf_analyzer underneath) profiles `kiln serve` the way Triton users
profile a TensorRT-LLM ensemble: KServe streaming, no model version given (perf_analyzer
picks the version whose ModelStatistics queue.count grew). Skipped where genai-perf is not
installed (`bash ../shared/tools/genai-perf-setup.sh` installs it and perf_analyzer under
$GP, default /tmp/gp)."""
from __future__ import annotations

import json

import pytest

from bench.genai_perf import genai_perf_env, profile, tokenizer_dir
from tests.server_helpers import ServerProcess

pytestmark = pytest.mark.model

MODEL = "tiny-random"


def test_genai_perf_profiles_kiln_serve(tiny_plan, tmp_path):
    env = genai_perf_env()
    if env is None:
        pytest.skip("genai-perf / perf_analyzer are not installed "
                    "(bash ../shared/tools/genai-perf-setup.sh)")
    server = ServerProcess(tiny_plan, "--drain-seconds", "5", log_path=tmp_path / "serve.log")
    try:
        server.wait_serving()
        data = profile(env, server.url, tokenizer_dir(tiny_plan, tmp_path / "tok"),
                       tmp_path / "artifacts", MODEL)
        print(json.dumps({k: data[k] for k in ("request_throughput",
                                               "output_token_throughput") if k in data}))
        assert data["request_throughput"]["avg"] > 0
        assert data["output_token_throughput"]["avg"] > 0
        assert data["time_to_first_token"]["avg"] > 0
    finally:
        assert server.terminate() == 0, server.log()
