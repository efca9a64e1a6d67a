"""The plan: one manifest (`plan.json`), one loader (`load_plan`).

A plan is refused, before anything runs, when it cannot run correctly here: wrong format
version, a file whose checksum does not match, a CPU ISA or compute capability this machine
lacks, a torch the compiled code was not built for. Each refusal says what the plan needs,
what this machine has, and the command that rebuilds it.
"""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kiln import PLAN_FORMAT_VERSION as FORMAT_VERSION

# Plan format versions:
# 1: kiln 0.1-0.2.
# 2: kv_cache.dtype may be int8/fp8 (pool rows of codes + a scale: plugins/paged_kv/kv_format)
#    and bf16 plans run the quant plugin's linear_bf16; a version-1 runtime could not run them.
MANIFEST = "plan.json"

# CPU ISA names (as AOTInductor's cpu_vec_isa names them) -> /proc/cpuinfo flags they need.
ISA_CPU_FLAGS = {
    "none": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512dq", "avx512vl", "avx512bw"),
    "amx_tile": ("amx_tile", "amx_bf16", "amx_int8", "avx512f"),
    "asimd": ("asimd",),
    "neon": ("asimd",),
    "sve256": ("sve",),
}


class PlanError(RuntimeError):
    """A plan that cannot be loaded here; the message is meant for a person."""


@dataclass
class Plan:
    """A verified plan directory and its manifest."""

    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def model_config(self) -> dict:
        return self.manifest["model"]["config"]

    @property
    def limits(self) -> dict:
        return self.manifest["limits"]

    @property
    def generation(self) -> dict:
        return json.loads((self.path / "generation.json").read_text())

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"

    def file(self, rel: str) -> Path:
        return self.path / rel


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise PlanError(f"{path} is not a plan directory (no such directory). "
                        "Build one with: kiln build model_specs/<spec>.yaml")
    if not mpath.is_file():
        raise PlanError(f"{path} is not a plan: it has no {MANIFEST}. "
                        "Build one with: kiln build model_specs/<spec>.yaml")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{mpath} is corrupt (not valid JSON: {e}). "
                        f"Rebuild the plan: {rebuild_command(None, path)}") from None
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise PlanError(f"{mpath} is not a Kiln plan manifest (no format_version). "
                        f"Rebuild the plan: {rebuild_command(None, path)}")
    return manifest


def rebuild_command(manifest: dict | None, path: Path) -> str:
    spec = (manifest or {}).get("spec_path") or "model_specs/<spec>.yaml"
    return f"kiln build {spec} --force"


def cpu_flags() -> set[str]:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_target() -> dict:
    """What this machine offers a plan: arch, CPU flags, CUDA compute capability."""
    cc = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"sm_{major}{minor}"
    return {"arch": platform.machine(), "cpu_flags": cpu_flags(), "compute_capability": cc}


def check_target(manifest: dict, path: Path, machine: dict | None = None) -> None:
    """Refuse a plan whose target this machine cannot run."""
    machine = machine or machine_target()
    target = manifest["target"]
    fix = rebuild_command(manifest, path)
    if target.get("arch") and target["arch"] != machine["arch"]:
        raise PlanError(f"plan {path} was compiled for {target['arch']} CPUs; this machine is "
                        f"{machine['arch']}. Rebuild it here: {fix}")
    isa = target.get("isa", "none")
    needed = ISA_CPU_FLAGS.get(isa)
    if needed is None:
        raise PlanError(f"plan {path} needs CPU ISA {isa!r}, which this kiln does not know. "
                        f"Rebuild it here: {fix}")
    missing = [f for f in needed if f not in machine["cpu_flags"]]
    if missing:
        has = sorted(f for f in machine["cpu_flags"] if f.startswith(("avx", "amx", "fma", "sse4")))
        raise PlanError(f"plan {path} was compiled for CPU ISA {isa} (needs {', '.join(needed)}); "
                        f"this CPU lacks {', '.join(missing)} (it has {', '.join(has) or 'none'}). "
                        f"Rebuild the plan on this machine: {fix}")
    cc = target.get("compute_capability")
    if target.get("device", "cpu") != "cpu":
        if machine["compute_capability"] is None:
            raise PlanError(f"plan {path} targets {target['device']} ({cc}); this machine has no "
                            f"CUDA GPU. Build a CPU plan instead (target.device: cpu) with: {fix}")
        if machine["compute_capability"] != cc:
            raise PlanError(f"plan {path} was compiled for compute capability {cc}; this GPU is "
                            f"{machine['compute_capability']}. Rebuild it here: {fix}")


def check_toolchain(manifest: dict, path: Path) -> None:
    built = manifest["toolchain"]["torch"]
    if built != torch.__version__:
        raise PlanError(f"plan {path} was compiled with torch {built}; this runtime has torch "
                        f"{torch.__version__}, and compiled engines only run on the torch they "
                        f"were built with. Install torch=={built}, or rebuild: "
                        f"{rebuild_command(manifest, path)}")


def check_files(manifest: dict, path: Path) -> None:
    fix = rebuild_command(manifest, path)
    for rel, meta in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise PlanError(f"plan {path} is incomplete: {rel} is missing. Rebuild: {fix}")
        size = f.stat().st_size
        if size != meta["size"]:
            raise PlanError(f"plan {path} is corrupt: {rel} is {size} bytes, the manifest says "
                            f"{meta['size']}. Rebuild: {fix}")
        if sha256_file(f) != meta["sha256"]:
            raise PlanError(f"plan {path} is corrupt: {rel} does not match its sha256 in the "
                            f"manifest (changed after the build). Rebuild: {fix}")


def load_plan(path: str | Path, verify_checksums: bool = True) -> Plan:
    """Read and verify a plan directory (format, target, toolchain, checksums)."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest["format_version"] != FORMAT_VERSION:
        raise PlanError(f"plan {path} has format version {manifest['format_version']}; this "
                        f"runtime reads version {FORMAT_VERSION}. Rebuild it with this kiln: "
                        f"{rebuild_command(manifest, path)}")
    check_target(manifest, path)
    check_toolchain(manifest, path)
    if verify_checksums:
        check_files(manifest, path)
    return Plan(path=path, manifest=manifest)


StepFn = Callable[..., torch.Tensor]


def load_step_fn(plan: Plan) -> StepFn:
    """Load the plan's kernels, then its compiled engine; returns the step callable.

    The callable takes the engine-step inputs of DESIGN.md in order:
    (input_ids, positions, slot_mapping, block_tables, context_lens, query_start_loc,
     logits_indices, k_caches, v_caches) -> logits [B, vocab] float32.
    """
    import importlib

    from plugins.cpp_build import load_library

    engine = plan.manifest["engine"]
    for name in engine.get("plugins", ["paged_kv"]):  # op schemas before the engine loads
        importlib.import_module(f"plugins.{name}")
    for lib in engine.get("kernels", []):
        load_library(plan.path / lib)
    f = plan.path / engine["file"]
    if engine["backend"] == "aoti":
        runner = torch._inductor.aoti_load_package(str(f))

        def step(*args):
            return runner(*args)
        return step
    if engine["backend"] == "eager":
        module = torch.export.load(str(f)).module()

        def step(*args):
            return module(*args)
        return step
    raise PlanError(f"plan {plan.path} uses engine backend {engine['backend']!r}, which this "
                    f"runtime cannot run. Rebuild: {rebuild_command(plan.manifest, plan.path)}")


def plan_summary(manifest: dict) -> dict[str, Any]:
    """The few facts a person wants first (used by `kiln inspect` and the runtime's log)."""
    m = manifest
    return {
        "name": m["name"],
        "model": m["model"].get("source"),
        "parameters": m["model"].get("num_parameters"),
        "precision": m["precision"],
        "target": m["target"],
        "limits": m["limits"],
        "fingerprint": m["fingerprint"],
    }
