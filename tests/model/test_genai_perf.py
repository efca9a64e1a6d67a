"""NVIDIA genai-perf (perf_analyzer underneath) profiles `kiln serve` the way Triton users
profile a TensorRT-LLM ensemble: KServe streaming, no model version given (perf_analyzer
picks the version whose ModelStatistics queue.count grew). Skipped where genai-perf is not
installed (`bash ../shared/tools/genai-perf-setup.sh` installs it and perf_analyzer under
$GP, default /tmp/gp)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server_helpers import ServerProcess

pytestmark = pytest.mark.model

MODEL = "tiny-random"


def genai_perf_env() -> dict | None:
    """The environment genai-perf and perf_analyzer run in, or None where not installed."""
    env = dict(os.environ)
    gp = Path(os.environ.get("GP", "/tmp/gp"))
    if (gp / "env.sh").is_file():   # the setup script's PATH and LD_LIBRARY_PATH
        out = subprocess.run(["bash", "-c", f". {gp / 'env.sh'} && env -0"],
                             capture_output=True, check=True).stdout
        env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    if not (shutil.which("genai-perf", path=env.get("PATH"))
            and shutil.which("perf_analyzer", path=env.get("PATH"))):
        return None
    return env


def tokenizer_dir(plan: Path, where: Path) -> Path:
    """The plan's tokenizer as a Hugging Face tokenizer directory (genai-perf counts tokens
    with it; nothing is downloaded)."""
    where.mkdir()
    shutil.copy(plan / "tokenizer.json", where / "tokenizer.json")
    (where / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast"}))
    return where


def profile(env: dict, url: str, tokenizer: Path, out: Path, concurrency: int = 4,
            requests: int = 32, input_tokens: int = 64, output_tokens: int = 32,
            model: str = MODEL) -> dict:
    """Run `genai-perf profile` (KServe, tensorrtllm backend, streaming) -> its JSON export."""
    cmd = ["genai-perf", "profile", "-m", model, "--endpoint-type", "kserve",
           "--backend", "tensorrtllm", "--streaming", "-u", url,
           "--tokenizer", str(tokenizer), "--concurrency", str(concurrency),
           "--request-count", str(requests),   # (perf_analyzer 2.51 hung on a warmup)
           "--synthetic-input-tokens-mean", str(input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_tokens),
           "--output-tokens-mean-deterministic", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    exports = list(out.rglob("*genai_perf.json"))
    assert exports, (r.stdout[-2000:], sorted(out.rglob("*")))
    return json.loads(exports[0].read_text())


def test_genai_perf_profiles_kiln_serve(tiny_plan, tmp_path):
    env = genai_perf_env()
    if env is None:
        pytest.skip("genai-perf / perf_analyzer are not installed "
                    "(bash ../shared/tools/genai-perf-setup.sh)")
    server = ServerProcess(tiny_plan, "--drain-seconds", "5", log_path=tmp_path / "serve.log")
    try:
        server.wait_serving()
        data = profile(env, server.url, tokenizer_dir(tiny_plan, tmp_path / "tok"),
                       tmp_path / "artifacts")
        print(json.dumps({k: data[k] for k in ("request_throughput",
                                               "output_token_throughput") if k in data}))
        assert data["request_throughput"]["avg"] > 0
        assert data["output_token_throughput"]["avg"] > 0
        assert data["time_to_first_token"]["avg"] > 0
    finally:
        assert server.terminate() == 0, server.log()
