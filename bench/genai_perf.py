"""NVIDIA genai-perf (perf_analyzer underneath) against `kiln serve`, the way Triton users
profile a TensorRT-LLM ensemble: KServe streaming, the tensorrtllm backend's inputs. Shared by
`bench/serving_efficiency.py` and `tests/model/test_genai_perf.py`.
`bash ../shared/tools/genai-perf-setup.sh` installs both under $GP (default /tmp/gp)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence


def genai_perf_env() -> Optional[dict]:
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
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(plan / "tokenizer.json", where / "tokenizer.json")
    (where / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast"}))
    return where


def profile(env: dict, url: str, tokenizer: Path, out: Path, model: str, concurrency: int = 4,
            requests: int = 32, input_tokens: int = 64, output_tokens: int = 32,
            prefix: Sequence[str] = ()) -> dict:
    """Run `genai-perf profile` (KServe, tensorrtllm backend, streaming; no sampling inputs,
    so greedy, as TensorRT-LLM decodes them) -> its JSON export. `prefix`: a command to run it
    under (e.g. taskset)."""
    cmd = [*prefix, "genai-perf", "profile", "-m", model, "--endpoint-type", "kserve",
           "--backend", "tensorrtllm", "--streaming", "-u", url,
           "--tokenizer", str(tokenizer), "--concurrency", str(concurrency),
           "--request-count", str(requests),   # (perf_analyzer 2.51 hung on a warmup)
           "--synthetic-input-tokens-mean", str(input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_tokens),
           "--output-tokens-mean-deterministic", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    if r.returncode != 0:
        raise RuntimeError(f"genai-perf failed ({r.returncode}):\n{r.stdout[-3000:]}"
                           f"{r.stderr[-3000:]}")
    exports = list(out.rglob("*genai_perf.json"))
    if not exports:
        raise RuntimeError(f"genai-perf wrote no JSON export under {out}:\n{r.stdout[-2000:]}")
    return json.loads(exports[0].read_text())
