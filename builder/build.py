"""`kiln build`: spec -> frozen, verified plan directory.

    load spec -> open checkpoint -> fingerprint (up to date? stop) -> load weights (streamed)
    -> quantize -> build kernels -> torch.export -> AOTInductor -> check the compiled step
    against the eager model -> manifest with checksums -> atomic rename into place

Everything is written into a temporary sibling directory; the rename at the end is the only
step that touches the output path, so a failed or interrupted build leaves nothing there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kiln.builder.draft import (check_draft, draft_current, load_draft_spec,
                                speculative_section)
from kiln.builder.memory import (DISK_FULL_TEXTS, build_refusal, disk_full, gib,
                                 peak_rss_bytes, plan_disk_bytes)
from kiln.builder.progress import Progress
from kiln.builder.spec import Spec, SpecError, default_output, load_spec, parse_memory
from kiln.builder.uptodate import quick_key, quick_up_to_date
from kiln.contracts import MANIFEST_FILE, PLAN_FORMAT_VERSION, FieldError
from kiln.contracts.manifest import (AccuracyRecord, CheckSection, EngineSection, FileEntry,
                                     KVCacheSection, LimitsSection, ModelSection, PlanManifest,
                                     PrecisionSection, QuantizationRecord, SchedulerSection,
                                     DraftRecord, TargetSection, ToolchainSection)
from kiln.contracts.manifest import BuildRecord, LoraSection

# torch, the checkpoint readers and the compiler are imported inside the functions that
# need them: an up-to-date check must answer in well under 2 seconds.


class BuildError(RuntimeError):
    """A build that failed for a reason a person can act on."""
    # the failure behind it holds an object whose finalizer aborts the process (a full disk:
    # torch's archive writer); a command line reports the error and exits without finalizers
    abandon_process = False


@dataclass
class BuildResult:
    path: Path
    fingerprint: str
    rebuilt: bool
    reason: str
    seconds: float
    manifest: PlanManifest


def check_spec_against_model(spec: Spec, cfg) -> None:
    """Cross-checks that need the model's config (the spec alone cannot know them)."""
    problems = []
    if spec.limits.max_seq_len > cfg.max_position_embeddings:
        problems.append(("limits.max_seq_len", f"{spec.limits.max_seq_len} is beyond the "
                         f"model's context of {cfg.max_position_embeddings} tokens; allowed: "
                         f"16..{cfg.max_position_embeddings}"))
    if problems:
        raise SpecError(spec.name, problems)


def check_build_machine(spec: Spec) -> None:
    """AOTInductor compiles for the device it runs on: a GPU plan needs that GPU here."""
    if not spec.target.is_gpu:
        return
    from kiln.builder import gpu

    try:
        gpu.check_build_machine(spec)
    except gpu.GpuBuildError as e:
        raise BuildError(str(e)) from None
    # The Triton kernels and the CUDA-graph decode ladder pass the gpu test tier on an H200,
    # but a whole GPU plan has not yet been built, loaded and served there with the torch this
    # version pins: no GPU plan is built until one has.
    raise BuildError(f"target.device {spec.target.device!r}: this version of kiln builds CPU "
                     "plans; its CUDA engine path has not been validated on hardware yet. "
                     "Set target.device: cpu.")


def plan_fingerprint(spec: Spec, ckpt, target: TargetSection | None = None,
                     draft: DraftRecord | None = None) -> tuple[str, dict]:
    from kiln.builder.fingerprint import fingerprint, fingerprint_inputs

    inputs = fingerprint_inputs(spec, ckpt.weights_digest, target)
    if draft is not None:     # a rebuilt draft plan rebuilds the plans it drafts for
        inputs["draft"] = draft.fingerprint
    return fingerprint(inputs), inputs


def resolve_target(spec: Spec) -> TargetSection:
    """The manifest's target for this spec on this machine; BuildError when it cannot be built
    here (a CPU ISA whose features this machine lacks)."""
    from kiln.builder.fingerprint import build_target
    from kiln.builder.target import TargetError

    try:
        return build_target(spec)
    except TargetError as e:
        raise BuildError(str(e)) from None


def is_up_to_date(out: Path, fp: str) -> bool:
    """A plan at `out` with this fingerprint whose files are all present at their sizes."""
    from kiln.runtime.plan import read_manifest

    try:
        manifest = read_manifest(out)   # PlanError for another format version
    except Exception:
        return False
    if manifest.fingerprint != fp:
        return False
    return all((out / rel).is_file() and (out / rel).stat().st_size == meta.size
               for rel, meta in manifest.files.items())


def kv_cache_section(spec: Spec) -> KVCacheSection:
    from kiln.plugins.paged_kv import kv_format

    kind, value = parse_memory(spec.kv_cache.memory)
    return KVCacheSection(tokens_per_block=spec.kv_cache.tokens_per_block, dtype=spec.kv_dtype,
                          memory=spec.kv_cache.memory,
                          budget_bytes=int(value) if kind == "bytes" else None,
                          budget_fraction=None if kind == "bytes" else float(value),
                          pool_order=kv_format.POOL_ORDER)


def build(spec_path: str | os.PathLike, out: str | os.PathLike | None = None,
          force: bool = False, progress: Progress | None = None,
          max_memory: Optional[int] = None, draft_plan: Optional[Path] = None) -> BuildResult:
    """Build the plan for a spec (or report it up to date). Raises SpecError/BuildError;
    BuildError before any work when the build cannot fit in memory (builder/memory.py;
    max_memory: the bytes it may use, instead of what the machine has available) or its plan
    on the disk, and when the disk fills up during the build (nothing left behind). A draft
    spec the spec names is built (or found up to date) at its default output first, unless
    `draft_plan` gives its built plan (kiln ci: the stored one)."""
    t0 = time.perf_counter()
    progress = progress or Progress()
    spec = load_spec(spec_path)
    out = Path(out) if out else default_output(spec)
    if (drafter := load_draft_spec(spec, spec_path)) is not None and draft_plan is None:
        draft_plan = build(drafter[0], default_output(drafter[1]), progress=progress,
                           max_memory=max_memory).path
    if not force and (manifest := quick_up_to_date(spec, out)) is not None \
            and draft_current(spec, spec_path, manifest, draft_plan):
        return BuildResult(out, manifest.fingerprint, False, "up to date",
                           time.perf_counter() - t0, manifest)
    from kiln.builder.sources import open_checkpoint

    check_build_machine(spec)
    ckpt = open_checkpoint(spec.model)
    check_spec_against_model(spec, ckpt.config)
    ckpt.config = ckpt.config.for_max_seq_len(spec.limits.max_seq_len)   # LongRoPE's set
    target = resolve_target(spec)
    must_build = force or not (out / MANIFEST_FILE).is_file()   # no fingerprint to match
    if must_build and (too_big := build_refusal(spec, ckpt, max_memory, out)) is not None:
        raise BuildError(f"{spec.name}: {too_big}")     # nothing to be up to date with: the
        #                                                 weights are not even hashed
    draft = check_draft(spec, spec_path, ckpt, target, out, draft_plan)
    fp, fp_inputs = plan_fingerprint(spec, ckpt, target, draft)
    if not force and (manifest := _current_manifest(out, fp)) is not None:
        return BuildResult(out, fp, False, "up to date", time.perf_counter() - t0, manifest)

    if not must_build and (too_big := build_refusal(spec, ckpt, max_memory, out)) is not None:
        raise BuildError(f"{spec.name}: {too_big}")     # before any weight is read
    out.parent.mkdir(parents=True, exist_ok=True)
    with _output_lock(out, progress):
        # another build of `out` (a second CI job, a second test worker) may have written it
        # while this one waited for the lock
        if not force and (manifest := _current_manifest(out, fp)) is not None:
            return BuildResult(out, fp, False, "up to date", time.perf_counter() - t0, manifest)
        _sweep_stale(out)
        tmp = out.with_name(f".{out.name}.building-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            manifest = _build_into(tmp, spec, spec_path, ckpt, target, fp, fp_inputs, progress,
                                   draft)
            _replace_dir(tmp, out)
        except BaseException as e:
            room = _room(tmp)        # before the partial build's files are removed
            shutil.rmtree(tmp, ignore_errors=True)
            need = plan_disk_bytes(spec, ckpt)
            full = disk_full(e) or (e if isinstance(e, Exception) and room is not None
                                    and room < need else None)
            if full is not None:
                err = BuildError(
                    f"{spec.name}: the disk that holds {out.parent} filled up while the plan "
                    f"was written ({_one_line(full)}; the plan needs ~{gib(need)}, the disk "
                    f"had room for {gib(room or 0)}); the partial build was removed and {out} "
                    "is as it was. Free space there and build again")
                # torch's archive writer, cut short, throws from its destructor when it is
                # freed (std::terminate); the failure, which holds it, goes with the error
                err.abandon_process = True
                raise err from e
            raise
    progress.done(f"plan written to {out}")
    return BuildResult(out, fp, True, "built", time.perf_counter() - t0, manifest)


def _room(tmp: Path) -> Optional[int]:
    """The bytes a failed build had on its disk: what is free plus what it wrote. Less than
    its plan needs: the disk filled up, whatever the error said (torch's archive writer
    reports a short write as "unexpected pos", without ENOSPC)."""
    try:
        free = shutil.disk_usage(tmp).free
        return free + sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    except OSError:
        return None


def _one_line(e: BaseException) -> str:
    """An error as one short line: an OSError's strerror and file, else the line quoting an
    out-of-space error, else its first line."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    lines = str(e).strip().splitlines()
    return next((ln for ln in lines if any(t in ln for t in DISK_FULL_TEXTS)),
                lines[0] if lines else type(e).__name__)[:300]


def _current_manifest(out: Path, fp: str):
    """The manifest of the plan at `out` when it is up to date with fingerprint `fp`."""
    if not is_up_to_date(out, fp):
        return None
    from kiln.runtime.plan import read_manifest

    return read_manifest(out)


@contextlib.contextmanager
def _output_lock(out: Path, progress: Progress):
    """Hold `.NAME.lock` beside `out` while a build of `out` runs, so that two builds of one
    output run one after the other. The file exists only while held: its holder removes it
    before the release, and a waiter that then locks a removed file opens the path again."""
    path = out.with_name(f".{out.name}.lock")
    waited = False
    while True:
        f = open(path, "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                progress.stage(f"waiting for another build of {out}")
                waited = True
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    if waited:
        progress.end_stage()
    try:
        yield
    finally:
        os.unlink(path)
        f.close()


def _sweep_stale(out: Path) -> None:
    """Remove what builds of `out` killed before their cleanup left beside it (a SIGKILL, the
    OOM killer, a CI job's timeout): `.NAME.building-PID` and `.NAME.old-PID` whose process is
    gone. A live PID's directories are another build's, and stay."""
    for kind in ("building", "old"):
        for d in out.parent.glob(f".{out.name}.{kind}-*"):
            pid = d.name.rsplit("-", 1)[1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process
        return True
    return True


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move tmp to out; an existing plan at out is swapped out, then removed."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


@dataclass(frozen=True)
class _Built:
    """What the build stages made, for the manifest."""
    quantization: QuantizationRecord
    engine: EngineSection
    check: Optional[CheckSection]
    accuracy: Optional[AccuracyRecord]
    draft: Optional[DraftRecord] = None    # the draft plan (speculative method draft)
    lora: Optional[LoraSection] = None     # the step takes adapters (a spec with lora)
    streamed: bool = False                 # weights quantized as loaded (builder/streaming.py)


def _build_into(tmp: Path, spec: Spec, spec_path, ckpt, target: TargetSection, fp: str,
                fp_inputs: dict, progress: Progress,
                draft: Optional[DraftRecord] = None) -> PlanManifest:
    """Build the plan's files into tmp, then its manifest (the one writer of plan.json).

    load fp32 -> reference (gated plans) -> quantize -> kernels, capture, compile -> check
    -> accuracy gate -> tokenizer and generation config -> plan.json"""
    import torch

    from kiln.builder import compile as kcompile
    from kiln.builder.memory import map_big_blocks, release_freed
    from kiln.builder.sources import load_model
    from kiln.builder.streaming import load_quantized_for, streams

    map_big_blocks()
    if streams(spec, ckpt.config):     # each linear packed as it loads; the reference loads its own
        gate = _reference(None, spec, ckpt, progress)
        model, quantization = load_quantized_for(spec, ckpt, progress)
    else:
        progress.stage(f"loading weights: {ckpt.source_desc}")
        # float32 whatever the precision: packing (int8/int4/fp8/bf16) is a transform after
        model = load_model(ckpt, dtype=torch.float32, progress=progress)
        model.eval()
        gate = _reference(model, spec, ckpt, progress)
        quantization = _quantize(model, spec, ckpt, progress)
    lora = _enable_lora(model, spec)
    engine = _compile(model, tmp, spec, target, progress, lora)
    progress.stage("checking the compiled step against the eager model")
    weights = _share_weights(model, tmp, engine)
    check = kcompile.check_engine(model, tmp, engine, spec, spec.kv_dtype, lora, weights)
    del model
    release_freed()
    accuracy = (None if gate is None
                else _accuracy_gate(gate, tmp, engine, spec, progress, lora, weights))
    del weights
    (tmp / "tokenizer.json").write_text(ckpt.tokenizer_json)
    (tmp / "generation.json").write_text(json.dumps(ckpt.generation, indent=2, sort_keys=True))
    manifest = _manifest(tmp, spec, spec_path, ckpt, target, fp, fp_inputs,
                         _Built(quantization, engine, check, accuracy, draft, lora,
                                streams(spec, ckpt.config)))
    (tmp / MANIFEST_FILE).write_text(manifest.dumps())
    return manifest


def _share_weights(model, tmp: Path, engine: EngineSection):
    """The plan's weights file mapped once for the check and the gate, the eager model's
    weights pointed at it (values checked equal) and its private copy freed: from here the
    build holds the weights once, in the page cache (None: weights inside the engine)."""
    if engine.weights is None:
        return None
    import gc

    from kiln.builder import compile as kcompile
    from kiln.builder.memory import release_freed
    from kiln.runtime.weights import map_weights

    gc.collect()     # the export's cyclic garbage still references the model's weights
    weights = map_weights(tmp / engine.weights.file, engine.weights, None)
    kcompile.bind_mapped_weights(model, weights.tensors)     # frees them one by one
    release_freed()
    return weights


def _reference(model, spec: Spec, ckpt, progress: Progress):
    """The accuracy gate with its reference computed (None: the plan is not gated)."""
    if spec.max_ppl_increase is None:
        return None
    from kiln.builder.accuracy_reference import Gate

    gate = Gate(spec, ckpt)
    # the fp32 model is at hand before packing its weights (cached or not)
    progress.stage(f"accuracy reference ({gate.reference_how(model)}) on {len(gate.ids)} "
                   "tokens")
    gate.compute_reference(model, progress)
    return gate


def _enable_lora(model, spec: Spec) -> Optional[LoraSection]:
    """Make the step take adapters (a spec with lora) -> the manifest's lora section."""
    if spec.lora is None:
        return None
    from kiln.builder.arch import lora as lora_arch

    try:
        model.enable_lora(spec.lora.target_modules)
    except ValueError as e:
        raise BuildError(str(e)) from None
    dims = lora_arch.module_dims(model.cfg)
    targets = spec.lora.target_modules
    return LoraSection(max_rank=spec.lora.max_rank, target_modules=targets,
                       max_adapters_per_batch=spec.lora.max_adapters_per_batch,
                       max_cpu_adapters=spec.lora.max_cpu_adapters, dtype=spec.lora.dtype,
                       in_features={m: dims[m][0] for m in targets},
                       out_features={m: dims[m][1] for m in targets})


def _compile(model, tmp: Path, spec: Spec, target: TargetSection,
             progress: Progress, lora: Optional[LoraSection] = None) -> EngineSection:
    """The plugins' kernels and the engine step, compiled into tmp -> the engine section."""
    from kiln.builder import compile as kcompile
    from kiln.plugins import isa as cpu_isa

    level = None if spec.target.is_gpu else cpu_isa.level(target.isa)
    progress.stage(f"building kernels (CPU ISA {level.name})" if level else "building kernels")
    moe = model.cfg.num_experts > 0
    kernels = kcompile.build_kernels(tmp / "kernels", spec, level, moe)
    kernel_paths = kcompile.kernel_paths(tmp, kernels, level)
    for lib, path in kernel_paths.items():
        progress.stage(f"kernel {lib}: {path}")

    limits = spec.limits
    max_blocks = math.ceil(limits.max_seq_len / spec.kv_cache.tokens_per_block)
    progress.stage(f"capturing the engine step (torch.export, backend {spec.target.backend})")
    captured = kcompile.capture(model, limits.max_num_tokens, limits.max_batch_size, max_blocks,
                                spec.kv_cache.tokens_per_block, spec.kv_dtype, lora)
    progress.stage("compiling ahead of time (AOTInductor)" if spec.target.backend == "aoti"
                   else "saving the exported program (eager backend)")
    # a CPU plan's weights: a file the runtime maps (runtime/weights.py)
    mapped = tmp / "weights.bin" if level is not None and spec.target.backend == "aoti" else None
    compiled = kcompile.compile_engine(captured, tmp / "engine.pt2", spec.target.backend,
                                       level, weights=mapped)
    del captured
    # The engine section, once: the build's check and accuracy gate load the engine by it.
    return EngineSection(backend=spec.target.backend, file=compiled.file.name,
                         weights=compiled.weights,
                         kernels=tuple(k.relative_to(tmp).as_posix() for k in kernels),
                         plugins=tuple(kcompile.engine_plugins(spec, moe)),
                         kernel_paths=kernel_paths, inputs=kcompile.input_names(lora is not None))


def _with_kernel_compute(built: _Built) -> QuantizationRecord:
    """The quantization record with how the compiled kernels compute bf16: from 8 rows of x in
    bf16 (products of bf16 pairs, float32 sums) where they do (the `avx512_bf16` and `amx`
    levels), else upcast to float32."""
    from kiln.builder.compile import kernels_compute_bf16

    q = built.quantization
    if q.bf16_compute and kernels_compute_bf16(built.engine):
        return dataclasses.replace(q, bf16_compute="bf16-from-8-rows")
    return q


def _manifest(tmp: Path, spec: Spec, spec_path, ckpt, target: TargetSection, fp: str,
              fp_inputs: dict, built: _Built) -> PlanManifest:
    """plan.json for the files in tmp (each with its size and sha256)."""
    from kiln.builder.fingerprint import toolchain
    from kiln.builder.sources import resolve_source
    from kiln.runtime.plan import sha256_file

    cfg, limits = ckpt.config, spec.limits
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = f.relative_to(tmp).as_posix()
        files[rel] = FileEntry(size=f.stat().st_size, sha256=sha256_file(f))
    return PlanManifest(
        format_version=PLAN_FORMAT_VERSION,
        name=spec.name,
        fingerprint=fp,
        fingerprint_inputs=fp_inputs,
        quick_key=quick_key(spec),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        spec_path=(os.path.relpath(spec_path) if not os.path.isabs(str(spec_path))
                   else str(spec_path)),
        spec=spec.canonical(),
        model=ModelSection(
            family=cfg.family, config=cfg.to_dict(), num_parameters=cfg.num_parameters,
            source=ckpt.source_desc,
            source_path=(None if spec.model.source == "random"
                         else resolve_source(spec.model.source)),
            weights_digest=ckpt.weights_digest),
        target=target,
        toolchain=ToolchainSection(**toolchain()),
        precision=PrecisionSection(weights=spec.precision.weights, kv_cache=spec.kv_dtype,
                                   activations=spec.precision.activations,
                                   quantization=_with_kernel_compute(built)),
        limits=LimitsSection(max_batch_size=limits.max_batch_size,
                             max_seq_len=limits.max_seq_len, max_input_len=limits.input_len,
                             max_num_tokens=limits.max_num_tokens),
        kv_cache=kv_cache_section(spec),
        scheduler=SchedulerSection(**spec.scheduler.model_dump(mode="json")),
        engine=built.engine,
        check=built.check,
        accuracy=built.accuracy,
        files=files,
        speculative=speculative_section(spec, built.draft),
        lora=built.lora,
        build=BuildRecord(peak_rss_bytes=peak_rss_bytes(),
                          plan_bytes=sum(f.size for f in files.values()),
                          streamed=built.streamed),
    )


def _quantize(model, spec: Spec, ckpt, progress: Progress) -> QuantizationRecord:
    """Swap the model's linears for packed ones (int8/int4/fp8/bf16); -> the manifest's record."""
    p = spec.precision
    if not spec.packed_weights:
        return QuantizationRecord(weights=p.weights, scheme=None)
    from kiln.builder.quantize import quantize_model

    calibration = None
    if spec.accuracy.calibration_text is not None:
        from kiln.builder.accuracy_reference import calibration_runner

        calibration = calibration_runner(spec, ckpt)
    progress.stage(("fp32 linears on the quant plugin's GEMV" if p.weights == "fp32" else
                    f"quantizing to {p.weights}") + (
        " + int8 activations" if p.activations == "int8" else "") + (
        (" (SmoothQuant calibration)" if p.activations == "int8" else
         " (AWQ-style calibration)") if calibration
                                                   else ""))
    keep = () if p.weights in ("bf16", "fp32") else p.keep_high_precision
    try:
        record = quantize_model(model, p.weights, group_size=p.group_size,
                                keep_high_precision=keep, calibration=calibration,
                                activations="int8" if p.activations == "int8" else "float",
                                device=spec.target.device)
    except ValueError as e:   # FieldError: the quantize_model argument = the precision field
        path = f"precision.{e.field}" if isinstance(e, FieldError) else "precision.weights"
        raise SpecError(spec.name, [(path, str(e))]) from None
    return dataclasses.replace(record, group_size_source=(
        "spec" if p.group_size is not None else "auto" if p.weights == "int4" else None))


def _accuracy_gate(gate, tmp: Path, engine: EngineSection, spec: Spec,
                   progress: Progress, lora: Optional[LoraSection] = None,
                   weights=None) -> AccuracyRecord:
    """Run the compiled plan on the evaluation text (a LoRA plan: its base model; weights: its
    mapped weights, None: mapped here); BuildError when over the limit."""
    from kiln.builder.accuracy_reference import gate_message
    from kiln.runtime.lora_buffers import base_only
    from kiln.runtime.plan import load_engine

    progress.stage(f"accuracy gate: compiled plan vs unquantized model on {len(gate.ids)} "
                   f"tokens of {gate.text_name}")
    step = load_engine(tmp, engine, weights=weights)
    if lora is not None:
        step = base_only(step, lora, gate.ckpt.config.num_layers)
    score = gate.run(step, spec.kv_dtype, tmp)
    progress.stage("accuracy: " + score.describe(gate.text_name))
    msg = gate_message(score, spec.name, spec.precision.weights, spec.kv_dtype)
    if msg:
        raise BuildError(msg)
    return gate.record(score)
