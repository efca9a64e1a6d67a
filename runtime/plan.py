"""The plan: one manifest (`plan.json`, read by `read_manifest`), one loader (`load_plan`).

    plan dir --read_manifest--> PlanManifest (kiln.contracts.manifest: typed, validated)
             --load_plan--> Plan (format, target, toolchain, checksums of the data files)
             --load_step_fn--> the compiled step (its code files hashed as they are copied)

A plan is refused, before anything runs, when it cannot run correctly here: wrong format
version, a file whose checksum does not match, a CPU ISA or compute capability this machine
lacks, a torch the compiled code was not built for. Each refusal says what the plan needs,
what this machine has, and the command that rebuilds it.

Every file the runtime reads is listed in the manifest, inside the plan directory (no link
out), and read once: `load_plan` reads plan.json (its sha256 is the plan's digest: plan.json
holds every other file's sha256, so the digest names the whole plan) and each data file
(tokenizer, generation config with the chat template, accuracy reference), checks those bytes
against their sha256 and keeps them (`Plan.data`): the tokenizer is built from them, never
from the file again. The code (the engine and its kernels) is hashed by `load_step_fn` while
it copies it into a private directory, the copy being what is loaded.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from kiln.contracts import MANIFEST_FILE, PLAN_FORMAT_VERSION
from kiln.contracts.manifest import (EngineSection, FileEntry, LimitsSection, ManifestError,
                                     ModelShape, PlanManifest, TargetSection, manifest_digest)
from kiln.plugins import isa as cpu_isa
from kiln.runtime.weights import MappedWeights, WeightsError, map_weights


class PlanError(RuntimeError):
    """A plan that cannot be loaded here; the message is meant for a person. field: the
    manifest field at fault when there is one (`limits.max_seq_len`)."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


# The data files every plan has (builder/build.py writes them); the runtime reads them from
# Plan.data, never from the directory.
TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation.json"    # bos/eos ids, add_bos_token, the chat template
DATA_FILES = (TOKENIZER_FILE, GENERATION_FILE)


@dataclass
class Plan:
    """A verified plan directory and its manifest."""

    path: Path
    manifest: PlanManifest
    # rel -> the bytes of each data file (every file but the code), read once by load_plan
    # and checked against the manifest's sha256: the only copy the runtime uses.
    data: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    digest: Optional[str] = None   # sha256 of the plan.json bytes the manifest was read from

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def shape(self) -> ModelShape:
        return self.manifest.model.shape

    @property
    def limits(self) -> LimitsSection:
        return self.manifest.limits

    @property
    def generation(self) -> dict:
        """generation.json, parsed from its verified bytes."""
        try:
            gen = json.loads(self.data_file(GENERATION_FILE))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan {self.path}: {GENERATION_FILE} is not valid JSON ({e}). "
                            f"Rebuild: {rebuild_command(self.manifest.spec_path)}") from None
        if not isinstance(gen, dict):
            raise PlanError(f"plan {self.path}: {GENERATION_FILE} is not a JSON object. "
                            f"Rebuild: {rebuild_command(self.manifest.spec_path)}")
        return gen

    def data_file(self, rel: str) -> bytes:
        """The verified bytes of data file `rel` (read once, by load_plan)."""
        try:
            return self.data[rel]
        except KeyError:
            raise PlanError(f"plan {self.path}: {rel} was not read with it; load the plan with "
                            "load_plan, which reads each file the manifest lists once and "
                            "checks it against its sha256") from None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: str | Path, expect_digest: Optional[str] = None) -> PlanManifest:
    """The one reader of plan.json: PlanError for a directory that is not a plan, a manifest
    of another format version, or one with a bad field (named, in .field too).
    expect_digest: refuse a plan.json whose sha256 differs (check_digest)."""
    manifest, digest = _read_manifest(Path(path))
    check_digest(Path(path), digest, expect_digest)
    return manifest


def _read_manifest(path: Path) -> tuple[PlanManifest, str]:
    """(the manifest, its digest), both from one read of plan.json's bytes."""
    mpath = path / MANIFEST_FILE
    if not path.is_dir():
        raise PlanError(f"{path} is not a plan directory (no such directory). "
                        "Build one with: kiln build model_specs/<spec>.yaml")
    if not mpath.is_file():
        raise PlanError(f"{path} is not a plan: it has no {MANIFEST_FILE}. "
                        "Build one with: kiln build model_specs/<spec>.yaml")
    raw = _read_plan_file(path, MANIFEST_FILE, rebuild_command(None))
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{mpath} is corrupt (not valid JSON: {e}). "
                        f"Rebuild the plan: {rebuild_command(None)}") from None
    if not isinstance(data, dict) or "format_version" not in data:
        raise PlanError(f"{mpath} is not a Kiln plan manifest (no format_version). "
                        f"Rebuild the plan: {rebuild_command(None)}", "format_version")
    spec_path = data.get("spec_path") if isinstance(data.get("spec_path"), str) else None
    fix = rebuild_command(spec_path)
    if data["format_version"] != PLAN_FORMAT_VERSION:
        raise PlanError(f"plan {path} has format version {data['format_version']}; this "
                        f"runtime reads version {PLAN_FORMAT_VERSION}. Rebuild it with this kiln: "
                        f"{fix}", "format_version")
    try:
        return PlanManifest.from_json(data), manifest_digest(raw)
    except ManifestError as e:
        raise PlanError(f"{mpath} is corrupt: its field {e.field} is wrong ({e.problem}). "
                        f"Rebuild the plan: {fix}", e.field) from None


def check_digest(path: Path, digest: str, expected: Optional[str]) -> None:
    """Refuse a plan whose plan.json digest is not `expected` (None: any plan)."""
    if expected is not None and digest != expected.strip().lower():
        raise PlanError(f"plan {path} has digest {digest}, not the expected {expected.strip()} "
                        "(--expect-digest): it is another plan, or was changed", "digest")


def rebuild_command(spec_path: Optional[str]) -> str:
    """The command that rebuilds a plan from its spec (a placeholder when it is not known)."""
    return f"kiln build {spec_path or 'model_specs/<spec>.yaml'} --force"


def machine_target() -> dict:
    """What this machine offers a plan: arch, CPU flags, CUDA compute capability."""
    cc = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"sm_{major}{minor}"
    return {"arch": platform.machine(), "cpu_flags": cpu_isa.cpu_flags(),
            "compute_capability": cc}


def check_target(target: TargetSection, path: Path, machine: dict | None = None, *,
                 spec_path: Optional[str] = None, pinned_isa: str = "auto") -> None:
    """Refuse a plan whose target this machine cannot run. spec_path, pinned_isa: the spec
    the plan was built from and its target.isa (for the fix the message suggests)."""
    machine = machine or machine_target()
    spec = spec_path or "model_specs/<spec>.yaml"
    fix = rebuild_command(spec_path)
    if target.arch and target.arch != machine["arch"]:
        raise PlanError(f"plan {path} was compiled for {target.arch} CPUs; this machine is "
                        f"{machine['arch']}. Rebuild it here: {fix}")
    needed = target.cpu_features
    if needed is None:
        raise PlanError(f"plan {path} does not record the CPU features its code needs "
                        f"(target.cpu_features). Rebuild it with this kiln: {fix}",
                        "target.cpu_features")
    missing = cpu_isa.missing_features(needed, machine["cpu_flags"])
    if missing:
        best = cpu_isa.best_level(machine["cpu_flags"])
        how = (f"rebuild it on this machine (target.isa auto resolves to this machine's "
               f"level, {best.name}): kiln build {spec}" if pinned_isa == "auto" else
               f"set target.isa: {best.name} (this machine's level) or auto in {spec}, then "
               f"run: kiln build {spec}")
        raise PlanError(
            f"plan {path} was compiled for CPU ISA {target.isa} and needs CPU features "
            f"{', '.join(needed)}; this CPU lacks {', '.join(missing)}. To serve here, {how}",
            "target.cpu_features")
    cc = target.compute_capability
    if target.is_gpu:
        if machine["compute_capability"] is None:
            raise PlanError(f"plan {path} targets {target.device} ({cc}); this machine has no "
                            f"CUDA GPU. Build a CPU plan instead (target.device: cpu) with: {fix}")
        if machine["compute_capability"] != cc:
            raise PlanError(f"plan {path} was compiled for compute capability {cc}; this GPU is "
                            f"{machine['compute_capability']}. Rebuild it here: {fix}")


def check_toolchain(manifest: PlanManifest, path: Path) -> None:
    built = manifest.toolchain.torch
    if built != torch.__version__:
        raise PlanError(f"plan {path} was compiled with torch {built}; this runtime has torch "
                        f"{torch.__version__}, and compiled engines only run on the torch they "
                        f"were built with. Install torch=={built}, or rebuild: "
                        f"{rebuild_command(manifest.spec_path)}", "toolchain.torch")
    from kiln.plugins.shims import ops_abi

    ops = ops_abi()
    if manifest.toolchain.ops != ops:
        # its kernel libraries would register against other op schemas: torch aborts
        raise PlanError(f"plan {path} was built by a kiln whose kernel ops differ from this "
                        f"runtime's (op schemas {manifest.toolchain.ops or 'unrecorded'}, this "
                        f"runtime {ops}; kiln {manifest.toolchain.kiln}): its compiled kernels "
                        f"cannot run here. Rebuild: {rebuild_command(manifest.spec_path)}",
                        "toolchain.ops")


# The plugins a plan's engine may name (imported for their op schemas before it loads).
KNOWN_PLUGINS = ("paged_kv", "quant", "moe", "lora")


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
                        f"{rebuild_command(None)}", what)
    return f


def code_files(engine: EngineSection) -> list[str]:
    """The files a plan runs: its kernels, then its engine (in load order)."""
    return [*engine.kernels, engine.file]


def mapped_files(engine: EngineSection) -> list[str]:
    """The files a plan maps rather than reads (its weights: runtime/weights.py)."""
    return [engine.weights.file] if engine.weights is not None else []


def check_engine_entries(manifest: PlanManifest, path: Path) -> None:
    """The engine file and kernels are inside the plan and listed with checksums; the plugins
    are kiln's own."""
    engine, files = manifest.engine, manifest.files
    for what, rel in [("engine.file", engine.file),
                      *(("engine.kernels entry", k) for k in engine.kernels),
                      *(("engine.weights.file", w) for w in mapped_files(engine))]:
        confined(path, rel, what)
        if rel not in files:
            raise PlanError(f"plan {path} is refused: {what} {rel!r} is not among the files the "
                            "manifest checksums, so its bytes cannot be verified. Rebuild: "
                            f"{rebuild_command(manifest.spec_path)}", what)
    unknown = [n for n in engine.plugins if n not in KNOWN_PLUGINS]
    if unknown:
        raise PlanError(f"plan {path} is refused: its engine names plugins {unknown}; this "
                        f"runtime has {', '.join(KNOWN_PLUGINS)}. Rebuild: "
                        f"{rebuild_command(manifest.spec_path)}", "engine.plugins")


def check_files(manifest: PlanManifest, path: Path) -> dict[str, bytes]:
    """Every file is there at its size; each data file (all but the code) is read once, here,
    and must match its sha256 -> rel -> those bytes (Plan.data). The code files (engine,
    kernels) are hashed by load_step_fn as it copies them, the weights as it maps them: once,
    on the bytes it loads."""
    fix = rebuild_command(manifest.spec_path)
    for rel in DATA_FILES:
        if rel not in manifest.files:
            raise PlanError(f"plan {path} is refused: {rel} is not among the files its manifest "
                            f"checksums, so its bytes cannot be verified. Rebuild: {fix}", "files")
    code = set(code_files(manifest.engine)) | set(mapped_files(manifest.engine))
    data = {}
    for rel, meta in manifest.files.items():
        f = confined(path, rel, "files entry")
        if rel not in code:
            data[rel] = read_verified(path, rel, meta, fix)
            continue
        if not f.is_file():
            raise PlanError(f"plan {path} is incomplete: {rel} is missing. Rebuild: {fix}")
        size = f.stat().st_size
        if size != meta.size:
            raise PlanError(f"plan {path} is corrupt: {rel} is {size} bytes, the manifest says "
                            f"{meta.size}. Rebuild: {fix}")
    return data


def read_verified(path: Path, rel: str, expected: FileEntry, fix: str) -> bytes:
    """The bytes of plan file `rel`, read once and checked against the manifest's size and
    sha256; PlanError otherwise."""
    data = _read_plan_file(path, rel, fix, expected.size)
    if len(data) != expected.size:
        got = f"more than {expected.size}" if len(data) > expected.size else str(len(data))
        raise PlanError(f"plan {path} is corrupt: {rel} is {got} bytes, the manifest says "
                        f"{expected.size}. Rebuild: {fix}")
    if hashlib.sha256(data).hexdigest() != expected.sha256:
        raise PlanError(f"plan {path} is corrupt: {rel} does not match its sha256 in the "
                        f"manifest (changed after the build). Rebuild: {fix}")
    return data


def _read_plan_file(path: Path, rel: str, fix: str, size: Optional[int] = None) -> bytes:
    """A regular file inside the plan, read without following a link (a link, even one that
    stays inside, is refused: a plan is built of plain files). size: read at most one byte
    past it (enough to tell the file is longer)."""
    f = confined(path, rel, "file")
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _open_error(path, rel, fix, e, "read") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise PlanError(f"plan {path} is refused: {rel} is not a regular file. "
                            f"Rebuild: {fix}", "files")
        return fh.read() if size is None else fh.read(size + 1)


def verified_copy(path: Path, rel: str, into: Path, expected: Optional[FileEntry],
                  fix: str) -> Path:
    """Copy a plan file into a private directory, hashing the bytes it copies; the copy is
    what gets loaded, so a file swapped or changed after the build is never run. expected:
    the manifest's entry (None: a plan the builder is writing, not yet checksummed)."""
    src = confined(path, rel, "file")
    dst = into / Path(rel).name
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(1 << 22):
            h.update(block)
            fout.write(block)
    if expected is not None and h.hexdigest() != expected.sha256:
        raise PlanError(f"plan {path} is corrupt: {rel} does not match its sha256 in the "
                        f"manifest (changed after the build). Rebuild: {fix}")
    return dst


def load_plan(path: str | Path, expect_digest: Optional[str] = None) -> Plan:
    """Read and verify a plan directory (format, target, toolchain, checksums), reading
    plan.json and each data file once. expect_digest: refuse a plan whose plan.json sha256
    differs (a pinned plan: `kiln serve --expect-digest`)."""
    path = Path(path)
    manifest, digest = _read_manifest(path)
    check_digest(path, digest, expect_digest)
    check_target(manifest.target, path, spec_path=manifest.spec_path,
                 pinned_isa=manifest.pinned_isa)
    check_toolchain(manifest, path)
    check_engine_entries(manifest, path)
    return Plan(path=path, manifest=manifest, data=check_files(manifest, path), digest=digest)


StepFn = Callable[..., torch.Tensor]


def load_step_fn(plan: Plan) -> StepFn:
    """Load the plan's kernels, then its compiled engine, each verified against its sha256
    as it is copied; returns the step callable (see load_engine)."""
    return load_engine(plan.path, plan.manifest.engine, plan.manifest.files,
                       rebuild_command(plan.manifest.spec_path))


def load_engine(path: Path, engine: EngineSection,
                files: Optional[Mapping[str, FileEntry]] = None,
                fix: str = "kiln build <spec> --force",
                weights: Optional[MappedWeights] = None) -> StepFn:
    """Load the kernels and the compiled engine an engine section names, from `path`.

    files: the checksums the code must match (None: a plan the builder is writing, which runs
    it before the manifest exists). The callable takes the engine-step inputs of DESIGN.md in
    order: (input_ids, positions, slot_mapping, block_tables, context_lens, query_start_loc,
    logits_indices, k_caches, v_caches) -> logits [B, vocab] float32.
    weights: the weights file as the caller mapped it (the builder's check and gate share one
    mapping), held, not closed, by the step (None: mapped here, closed with the step).
    """
    import importlib
    import tempfile

    from kiln.plugins.cpp_build import load_library
    from kiln.plugins.engine_call import kernels as engine_call

    if engine.backend not in ("aoti", "eager"):
        raise PlanError(f"plan {path} uses engine backend {engine.backend!r}, which this "
                        f"runtime cannot run. Rebuild: {fix}", "engine.backend")
    for name in engine.plugins:  # op schemas before the engine loads
        if name not in KNOWN_PLUGINS:
            raise PlanError(f"plan {path} names an unknown plugin {name!r}", "engine.plugins")
        importlib.import_module(f"kiln.plugins.{name}")
    expected = (lambda rel: files.get(rel)) if files is not None else (lambda rel: None)
    # Kernels and engine are loaded from private copies of their verified bytes.
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as private:
        for lib in engine.kernels:
            load_library(verified_copy(path, lib, Path(private), expected(lib), fix))
        f = verified_copy(path, engine.file, Path(private), expected(engine.file), fix)
        if engine.backend == "aoti":
            owned = weights is None
            if owned:
                weights = _map_weights(path, engine, expected, fix)   # verified before any run
            if engine_call.available():   # the plan's kernels include the GIL-free call
                runner = _NoGilEngine.open(f, Path(private), path, fix)
            else:
                runner = _LoaderEngine(load_aoti_package(f, Path(private), path, fix))
            if weights is not None:
                runner.load_weights(weights, owned)
            return _aoti_step(runner, path, fix)
        runner = torch.export.load(str(f)).module()

    def step(*args):
        return runner(*args)
    return step


def _map_weights(path: Path, engine: EngineSection, expected: Callable, fix: str
                 ) -> Optional[MappedWeights]:
    """The engine's weights file mapped and checked against its sha256 (None: a plan whose
    weights are inside its engine file)."""
    if engine.weights is None:
        return None
    rel = engine.weights.file
    try:
        return map_weights(confined(path, rel, "engine.weights.file"), engine.weights,
                           expected(rel))
    except WeightsError as e:
        raise PlanError(f"plan {path} is corrupt: {e}. Rebuild: {fix}", "engine.weights") from None
    except OSError as e:
        raise _open_error(path, rel, fix, e, "map") from None


def _open_error(path: Path, rel: str, fix: str, e: OSError, verb: str) -> PlanError:
    """The PlanError for a plan file that could not be opened to `verb` (read, map): missing,
    a symbolic link (opened with O_NOFOLLOW), or another OS error."""
    if isinstance(e, FileNotFoundError):
        return PlanError(f"plan {path} is incomplete: {rel} is missing. Rebuild: {fix}")
    if e.errno == errno.ELOOP:
        return PlanError(f"plan {path} is refused: {rel} is a symbolic link; a plan's files "
                         f"are read as they are, never through a link. Rebuild: {fix}", "files")
    return PlanError(f"plan {path}: cannot {verb} {rel} ({e.strerror})")


def load_aoti_package(package: Path, scratch: Path, path: Optional[Path] = None,
                      fix: str = "rebuild the plan"):
    """The AOTInductor package at `package`, loaded from an unpacked copy inside `scratch`.

    torch's `aoti_load_package` unpacks a .pt2 into a /tmp/aotinductor_* directory that it
    removes only when the loader object is destroyed, which a process that exits without
    collecting it (or is killed) never does: every load left the plan's engine behind
    (95-517 MB for the SmolLM2 plans; 826 of them, 40 GB, filled the disk of this project's
    CI host). The loader does not own a directory it is given, so the package is unpacked
    into the caller's private directory and loaded from there; the caller removes it once
    loaded (the model's .so, weights included, stays mapped after its file is unlinked)."""
    from torch._inductor.package.package import AOTICompiledModel

    loader = torch._C._aoti.AOTIModelPackageLoader(
        str(_unpack(package, scratch, path, fix)), "model", False, 1, -1)
    return AOTICompiledModel(loader)


def _unpack(package: Path, scratch: Path, path: Optional[Path], fix: str) -> Path:
    """The .pt2 archive unpacked into a new directory inside `scratch`; returns its top folder."""
    import tempfile
    import zipfile

    unpacked = Path(tempfile.mkdtemp(prefix="unpacked-", dir=scratch))
    try:
        with zipfile.ZipFile(package) as z:
            z.extractall(unpacked)
    except (zipfile.BadZipFile, OSError) as e:
        raise PlanError(f"plan {path or package}: its engine file cannot be unpacked ({e}). "
                        f"Rebuild: {fix}", "engine.file") from None
    roots = [d for d in unpacked.iterdir() if d.is_dir()]
    return roots[0] if len(roots) == 1 else unpacked    # the archive's one top folder


class _LoaderEngine:
    """The compiled engine through torch's package loader (holds the GIL while it runs)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.loader = compiled.loader
        self.weights: Optional[MappedWeights] = None

    def load_weights(self, weights: MappedWeights, owned: bool = True) -> None:
        """The mapped weights as the engine's constants, not copied (user managed); owned: the
        engine unmaps them when it is dropped."""
        self.compiled.load_constants(weights.tensors, check_full_update=True, user_managed=True)
        self.weights = weights if owned else None
        self._held = weights

    def __del__(self):
        self.compiled = self.loader = None    # the runner first, then the pages it read
        if self.weights is not None:
            self.weights.close()

    def call_spec(self) -> list[str]:
        return self.loader.get_call_spec()

    def run(self, flat: list) -> list:
        return self.loader.boxed_run(flat)


class _NoGilEngine:
    """The compiled engine through the plan's kiln_engine_call library
    (plugins/engine_call): the same AOTInductor CPU runner the package loader creates, called
    as a torch op, which releases the GIL for the step. Closed (runner, weights, .so mapping
    freed) when the step that holds it is dropped."""

    def __init__(self, handle: int):
        self.handle = handle
        self._run = torch.ops.kiln_engine.run.default
        self.weights: Optional[MappedWeights] = None

    @classmethod
    def open(cls, package: Path, scratch: Path, path: Optional[Path], fix: str) -> "_NoGilEngine":
        models = sorted((_unpack(package, scratch, path, fix) / "data" / "aotinductor"
                         / "model").glob("*.so"))
        if len(models) != 1:
            raise PlanError(f"plan {path or package}: its engine holds {len(models)} compiled "
                            f"models, expected one. Rebuild: {fix}", "engine.file")
        return cls(torch.ops.kiln_engine.open(str(models[0])))

    def call_spec(self) -> list[str]:
        return torch.ops.kiln_engine.call_spec(self.handle)

    def run(self, flat: list) -> list:
        return self._run(self.handle, flat)

    def load_weights(self, weights: MappedWeights, owned: bool = True) -> None:
        """The mapped weights as the engine's constants, not copied (user managed); owned: the
        engine unmaps them when it is dropped."""
        names = list(weights.tensors)
        torch.ops.kiln_engine.load_constants(self.handle, names,
                                             [weights.tensors[n] for n in names])
        self.weights = weights if owned else None
        self._held = weights

    def __del__(self):
        try:
            torch.ops.kiln_engine.close(self.handle)
        except Exception:   # interpreter shutdown: the process is freeing everything anyway
            return
        if self.weights is not None:     # the runner is gone: nothing reads the pages now
            self.weights.close()


def _aoti_step(runner, path: Path, fix: str) -> StepFn:
    """The compiled engine's call without its per-call generic wrapper: AOTICompiledModel
    parses its input and output tree specs from JSON and flattens the arguments with pytree on
    every call (about 0.1 ms a step, 3% of a SmolLM2 decode step). The step's arguments are
    tensors and two lists of tensors (the KV pools), flattened here in pytree's order; the
    first call checks that order against the engine's own input spec."""
    import torch.utils._pytree as pytree

    in_spec, out_spec = (pytree.treespec_loads(s) for s in runner.call_spec())
    checked = False
    run = runner.run

    def step(*args):
        nonlocal checked
        if not checked:
            spec = pytree.tree_flatten((args, {}))[1]
            if spec != in_spec:
                raise PlanError(f"plan {path}: the engine takes inputs shaped {in_spec}, the "
                                f"runtime passes {spec}. Rebuild: {fix}", "engine.file")
            checked = True
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))]
        return pytree.tree_unflatten(run(flat), out_spec)
    step.engine = runner    # which call the step goes through (tests, diagnostics)
    return step


def plan_summary(manifest: PlanManifest) -> dict[str, Any]:
    """The few facts a person wants first (used by `kiln inspect` and the runtime's log)."""
    m = manifest
    return {
        "name": m.name,
        "model": m.model.source,
        "parameters": m.model.num_parameters,
        "precision": m.precision.to_json(),
        "target": m.target.to_json(),
        "limits": m.limits.to_json(),
        "fingerprint": m.fingerprint,
    }
