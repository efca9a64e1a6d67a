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
from plugins import isa as cpu_isa

# Plan format versions:
# 1: kiln 0.1-0.2.
# 2: kv_cache.dtype may be int8/fp8 (pool rows of codes + a scale: plugins/paged_kv/kv_format)
#    and bf16 plans run the quant plugin's linear_bf16; a version-1 runtime could not run them.
# 3: target.isa is a kiln ISA level (plugins/isa.py) and target.cpu_features lists the CPU
#    features the compiled code needs (asked of the compiler at build); engine.kernel_paths.
MANIFEST = "plan.json"

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


def machine_target() -> dict:
    """What this machine offers a plan: arch, CPU flags, CUDA compute capability."""
    cc = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"sm_{major}{minor}"
    return {"arch": platform.machine(), "cpu_flags": cpu_isa.cpu_flags(),
            "compute_capability": cc}


def check_target(manifest: dict, path: Path, machine: dict | None = None) -> None:
    """Refuse a plan whose target this machine cannot run."""
    machine = machine or machine_target()
    target = manifest["target"]
    fix = rebuild_command(manifest, path)
    if target.get("arch") and target["arch"] != machine["arch"]:
        raise PlanError(f"plan {path} was compiled for {target['arch']} CPUs; this machine is "
                        f"{machine['arch']}. Rebuild it here: {fix}")
    needed = target.get("cpu_features")
    if needed is None:
        raise PlanError(f"plan {path} does not record the CPU features its code needs "
                        f"(target.cpu_features). Rebuild it with this kiln: {fix}")
    missing = cpu_isa.missing_features(needed, machine["cpu_flags"])
    if missing:
        best = cpu_isa.best_level(machine["cpu_flags"])
        spec = manifest.get("spec_path") or "model_specs/<spec>.yaml"
        pinned = manifest.get("spec", {}).get("target", {}).get("isa", "auto")
        how = (f"rebuild it on this machine (target.isa auto resolves to this machine's "
               f"level, {best.name}): kiln build {spec}" if pinned == "auto" else
               f"set target.isa: {best.name} (this machine's level) or auto in {spec}, then "
               f"run: kiln build {spec}")
        raise PlanError(
            f"plan {path} was compiled for CPU ISA {target.get('isa')} and needs CPU features "
            f"{', '.join(needed)}; this CPU lacks {', '.join(missing)}. To serve here, {how}")
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


# The plugins a plan's engine may name (imported for their op schemas before it loads).
KNOWN_PLUGINS = ("paged_kv", "quant")


def confined(path: Path, rel: object, what: str) -> Path:
    """`path / rel` for a manifest entry that must name a file inside the plan directory:
    relative, no `..`, no symlink leading out. PlanError otherwise, before anything is read."""
    from pathlib import PurePosixPath

    bad = (not isinstance(rel, str) or not rel or "\\" in rel
           or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts)
    if not bad:
        f = path / rel
        bad = not f.resolve().is_relative_to(path.resolve())
    if bad:
        raise PlanError(f"plan {path} is refused: its manifest's {what} {rel!r} is not a path "
                        "inside the plan directory (absolute, '..' or a link out of it). A plan "
                        "runs its compiled code: load plans only from a trusted store. Rebuild: "
                        f"{rebuild_command(None, path)}")
    return f


def check_engine_entries(manifest: dict, path: Path) -> None:
    """The engine file and kernels are inside the plan and listed with checksums; the plugins
    are kiln's own."""
    engine, files = manifest["engine"], manifest.get("files", {})
    for what, rel in [("engine.file", engine.get("file")),
                      *(("engine.kernels entry", k) for k in engine.get("kernels", []))]:
        confined(path, rel, what)
        if rel not in files:
            raise PlanError(f"plan {path} is refused: {what} {rel!r} is not among the files the "
                            "manifest checksums, so its bytes cannot be verified. Rebuild: "
                            f"{rebuild_command(manifest, path)}")
    unknown = [n for n in engine.get("plugins", []) if n not in KNOWN_PLUGINS]
    if unknown:
        raise PlanError(f"plan {path} is refused: its engine names plugins {unknown}; this "
                        f"runtime has {', '.join(KNOWN_PLUGINS)}. Rebuild: "
                        f"{rebuild_command(manifest, path)}")


def check_files(manifest: dict, path: Path) -> None:
    fix = rebuild_command(manifest, path)
    for rel, meta in manifest["files"].items():
        f = confined(path, rel, "files entry")
        if not f.is_file():
            raise PlanError(f"plan {path} is incomplete: {rel} is missing. Rebuild: {fix}")
        size = f.stat().st_size
        if size != meta["size"]:
            raise PlanError(f"plan {path} is corrupt: {rel} is {size} bytes, the manifest says "
                            f"{meta['size']}. Rebuild: {fix}")
        if sha256_file(f) != meta["sha256"]:
            raise PlanError(f"plan {path} is corrupt: {rel} does not match its sha256 in the "
                            f"manifest (changed after the build). Rebuild: {fix}")


def verified_copy(plan: "Plan", rel: str, into: Path) -> Path:
    """Copy a plan file into a private directory, hashing the bytes it copies; the copy is
    what gets loaded, so a file swapped after verification is never run."""
    src = confined(plan.path, rel, "file")
    dst = into / Path(rel).name
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(1 << 22):
            h.update(block)
            fout.write(block)
    meta = plan.manifest.get("files", {}).get(rel)
    if meta is not None and h.hexdigest() != meta["sha256"]:
        raise PlanError(f"plan {plan.path} is corrupt: {rel} changed after it was verified. "
                        f"Rebuild: {rebuild_command(plan.manifest, plan.path)}")
    return dst


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
    check_engine_entries(manifest, path)
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
    import tempfile

    from plugins.cpp_build import load_library

    engine = plan.manifest["engine"]
    if engine["backend"] not in ("aoti", "eager"):
        raise PlanError(f"plan {plan.path} uses engine backend {engine['backend']!r}, which "
                        f"this runtime cannot run. Rebuild: "
                        f"{rebuild_command(plan.manifest, plan.path)}")
    for name in engine.get("plugins", ["paged_kv"]):  # op schemas before the engine loads
        if name not in KNOWN_PLUGINS:
            raise PlanError(f"plan {plan.path} names an unknown plugin {name!r}")
        importlib.import_module(f"plugins.{name}")
    # Kernels and engine are loaded from private copies of their verified bytes.
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as private:
        for lib in engine.get("kernels", []):
            load_library(verified_copy(plan, lib, Path(private)))
        f = verified_copy(plan, engine["file"], Path(private))
        if engine["backend"] == "aoti":
            runner = torch._inductor.aoti_load_package(str(f))
        else:
            runner = torch.export.load(str(f)).module()

    def step(*args):
        return runner(*args)
    return step


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
