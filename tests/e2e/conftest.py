"""The e2e tier's SmolLM2 plans, built two at a time by `kiln build` subprocesses.

A SmolLM2 build is about half single-threaded work (torch.export, Inductor's lowering, the
C++ compile) and half a two-thread accuracy gate, so two builds side by side on two cores
finish well before the same two one after the other. At the tier's first test, every plan
that a selected test needs starts building in the background (the first quantized build
computes the fp32 accuracy reference that the others then read from the cache, so it goes
first, beside the fp32 plan, which needs none); a test waits only for its own plan, then
opens it through `build()`, which finds it up to date. The plans go where `kiln build
model_specs/<name>.yaml` puts them (plans/), shared with the README and bench/.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT

# spec name -> the fixtures whose tests need it; listed in build order
PLANS = {
    "smollm2-135m-int8-cpu": {"quant_plan"},
    "smollm2-135m-cpu": {"smollm2_plan"},
    "smollm2-135m-int4-cpu": {"quant_plan"},
    "smollm2-135m-fp8-kv8-cpu": {"quant_plan"},
    "smollm2-135m-throughput-cpu": {"throughput_plan"},
}


def _kiln() -> str:
    exe = Path(sys.executable).with_name("kiln")
    return str(exe) if exe.exists() else (shutil.which("kiln") or "kiln")


class PlanBuilds:
    """`kiln build` of each named spec into plans/, at most two running at a time."""

    def __init__(self, names: list[str], log_dir: Path):
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="e2e-build")
        self._log_dir = log_dir
        self._builds: dict[str, Future] = {n: self._pool.submit(self._run, n) for n in names}

    def _run(self, name: str) -> subprocess.CompletedProcess:
        log = self._log_dir / f"{name}.log"
        with log.open("w") as out:
            return subprocess.run([_kiln(), "build", str(ROOT / "model_specs" / f"{name}.yaml"),
                                   "--out", str(ROOT / "plans" / name)],
                                  stdout=out, stderr=subprocess.STDOUT, check=False)

    def plan(self, name: str) -> Path:
        """The built plan (building it here if no selected test asked for it at the start)."""
        from kiln.builder.build import build
        from kiln.builder.progress import Progress

        future = self._builds.get(name) or self._builds.setdefault(
            name, self._pool.submit(self._run, name))
        done = future.result()
        if done.returncode != 0:
            tail = (self._log_dir / f"{name}.log").read_text()[-3000:]
            pytest.fail(f"kiln build {name} exited {done.returncode}:\n{tail}", pytrace=False)
        return build(ROOT / "model_specs" / f"{name}.yaml", ROOT / "plans" / name,
                     progress=Progress(enabled=False)).path

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session", autouse=True)
def smollm2_builds(request, smollm2_gguf, tmp_path_factory):
    wanted = set().union(*(item.fixturenames for item in request.session.items
                           if item.get_closest_marker("e2e")))
    names = [n for n, users in PLANS.items() if users & wanted]
    builds = PlanBuilds(names, tmp_path_factory.mktemp("e2e-builds"))
    yield builds
    builds.close()


@pytest.fixture(scope="session")
def smollm2_plan(smollm2_gguf, smollm2_builds) -> Path:
    """The default SmolLM2 CPU plan, at plans/smollm2-135m-cpu. Read-only."""
    return smollm2_builds.plan("smollm2-135m-cpu")


@pytest.fixture(scope="module", params=["int8", "int4", "fp8-kv8"])
def quant_plan(request, smollm2_gguf, smollm2_builds):
    """(precision, plan) of the int8, int4 (bf16 KV cache) and fp8 (fp8 KV cache) plans."""
    return request.param, smollm2_builds.plan(f"smollm2-135m-{request.param}-cpu")


@pytest.fixture(scope="module")
def throughput_plan(smollm2_gguf, smollm2_builds) -> Path:
    """model_specs/smollm2-135m-throughput-cpu.yaml's plan (W4A8, int8 KV cache)."""
    return smollm2_builds.plan("smollm2-135m-throughput-cpu")
