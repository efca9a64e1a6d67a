"""What a build uses and needs: its memory (peak RSS, the estimate) and its plan's disk.

    peak_rss_bytes()                              the process's peak resident set so far
    estimate(config, weights, keep, whole_fp32)   -> MemoryEstimate, from shapes alone
    build_refusal(spec, ckpt, max_memory, out)    the refusal of a build that cannot fit (in
                                                  memory, or its plan on the disk of `out`)
    plan_disk_bytes(spec, ckpt)                   the disk its plan needs while it is written
    disk_full(exc)                                the out-of-space error behind a failure

The estimate reads only shapes (the family's parameter shapes, which the source's tensor
index was checked against when the checkpoint was opened): no weight is read.
"""
from __future__ import annotations

import errno
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

GiB = 1 << 30
MAX_MEMORY_ENV = "KILN_BUILD_MAX_MEMORY"

# The builder's peak RSS model, from VmHWM measured on this AVX2 host with a Llama-3.2-1B-
# shaped random checkpoint (1.24 B params, fp32 4.60 GiB, bf16 safetensors in 2 shards;
# `python -m bench.scale make/load --shape 1b`), W4A8 + int8 KV (plan weights 0.81 GiB), and
# the tiny test model (0.1 M params: a build peaks at 0.56 GiB, all of it the fixed part):
#   whole fp32 model loaded, then quantize_model             7.01 GiB = 0.35 + 1.45 x fp32
#   the accuracy reference (eager fp32 model, not cached)     5.48 GiB = fp32 + 0.88
#   the same, layer by layer (builder/layerwise_reference.py) 2.32 GiB at 2048 tokens: the
#                                                             embedding's fp32 group (the
#                                                             largest) + activations
#   streaming load + quantize (builder/streaming.py)          1.93 GiB = plan + 0.35 + the
#                                                             largest tensor (embedding) in
#                                                             fp32 and bf16 at once
#   the rest of a streamed `kiln build` (plan 0.83 GiB):     4.11 GiB after AOTInductor,
#                                                             5.20 GiB in the accuracy gate
#                                                             (loading the compiled plan)
#                                                             = 1 + 5.05 x plan, when the
#                                                             plan's weights were inside
#                                                             the engine's .so
# and, with the weights in their own mapped file (plan format 4), on the Intel AMX host with
# a Llama-3.1-8B-shaped random checkpoint (8.03 B params, bf16 safetensors in 2 shards),
# W4A8 + int8 KV, plan 4.88 GiB, the reference cached:
#   load + quantize (tall weights by rows)                    8.10 GiB
#   AOTInductor                                               11.47 GiB
#   compiled-vs-eager check (eager model + mapped plan)       14.84 GiB
#   accuracy gate                                             15.33 GiB = 1 + 2.94 x plan
# and since the weights are held once (the step reads them as parameters; the check and the
# gate point the model at the mapped plan): load + quantize 6.95 GiB, then AOTInductor,
# check and gate end at 5.64, 5.48, 5.78 GiB = 1 + 0.98 x plan (1B: AOTInductor peaks at
# 2.03 GiB = 1 + 1.24 x plan).
# So: peak = FIXED + max(what holds the fp32 model, what holds the packed one).
FIXED_BYTES = 1 * GiB            # torch + kiln (0.35 GiB) + evaluation activations, rounded up
WHOLE_FP32_FACTOR = 1.45         # x fp32 bytes: load the fp32 model whole, then quantize it
REFERENCE_FP32_FACTOR = 1.0      # x fp32 bytes: the eager reference's model
COMPILE_PLAN_FACTOR = 1.3        # x plan bytes: compile, check, the gate's load of the plan
LARGEST_TENSOR_FACTOR = 1.0      # x the largest tensor's fp32 bytes: held whole in its
#                                   source's dtype (fp32 at most; bf16 for most checkpoints)
#                                   while it is packed, widened 8192 rows at a time (8B: 6.95
#                                   GiB measured = 1 + plan 4.88 + 0.55 x the 1.96 GiB
#                                   embedding from bf16; the estimate takes the fp32 case)

# Bytes per parameter of a quantized linear at each precision.weights: the packed values plus
# their scales (int4: a float16 scale and minimum per group of 32 in the W4A8 format; int8:
# one float32 scale per output row, small against the row).
_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
                    "int4": 0.5 + 4 / 32}


def _proc_kib(path: str, key: str) -> Optional[int]:
    """A `key: N kB` line of a /proc file, in bytes (None where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (VmHWM; ru_maxrss where /proc is absent)."""
    hwm = _proc_kib("/proc/self/status", "VmHWM:")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # kB on Linux


def rss_bytes() -> Optional[int]:
    """The process's resident set now (VmRSS; None where /proc is absent)."""
    return _proc_kib("/proc/self/status", "VmRSS:")


BIG_BLOCK_BYTES = 4 << 20       # the builder's blocks from this size are mapped on their own
_M_MMAP_THRESHOLD = -3           # glibc mallopt parameter


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def map_big_blocks() -> None:
    """Make glibc's malloc give every block of BIG_BLOCK_BYTES or more its own mapping, which
    a free returns to the system at once. Left to itself glibc raises that threshold to the
    largest block freed so far (up to 32 MB), and a streaming build's per-tensor temporaries
    (tens of MB each, thousands of them) then come from the heap, whose freed pages it keeps:
    a Llama-3.2-1B-shaped load + quantize ended 0.22 GiB higher and peaked 0.22 GiB higher.
    Process-wide and idempotent; nothing where there is no glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, BIG_BLOCK_BYTES)


def release_freed() -> None:
    """Hand the heap's freed pages back to the system (glibc malloc_trim), so a stage's RSS
    shows what it holds; nothing where there is no glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def mem_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    return _proc_kib("/proc/meminfo", "MemAvailable:")


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """What a build of one checkpoint at one precision needs, from shapes alone."""
    params: int              # parameters of the model (fused tensors counted once)
    fp32_bytes: int          # the weights in float32 (how the builder computes on them)
    plan_bytes: int          # the plan's weights at the spec's precision (approximate)
    largest_bytes: int       # the largest tensor in float32 (held whole while it is packed)
    peak_bytes: int          # the builder's expected peak RSS
    why: str                 # what sets the peak
    whole_fp32: str = ""     # what holds the whole fp32 model: "", reference or quantize

    def describe(self) -> str:
        return (f"needs ~{gib(self.peak_bytes)}: {self.params / 1e9:.2f} B parameters, "
                f"weights {gib(self.fp32_bytes)} fp32, plan ~{gib(self.plan_bytes)}; "
                f"peak = {self.why} + {gib(FIXED_BYTES)} fixed")


def estimate(config, weights: str, keep: tuple[str, ...], whole_fp32: str = ""
             ) -> MemoryEstimate:
    """The estimate for a model config (DecoderConfig) at precision.weights with
    keep_high_precision `keep`. whole_fp32: "" when the weights stream (builder/streaming.py)
    and nothing needs the fp32 model; "reference" when the gate's reference runs it;
    "quantize" when it is loaded whole and quantized (calibration)."""
    from kiln.builder.arch.families import param_shapes

    params = plan = largest = 0
    per = _BYTES_PER_PARAM.get(weights, 4.0)
    for name, shape in param_shapes(config).items():
        n = 1
        for d in shape:
            n *= int(d)
        params += n
        largest = max(largest, 4 * n)
        plan += int(n * _param_bytes(name, len(shape), weights, per, keep))
    fp32 = params * 4
    parts = {f"{COMPILE_PLAN_FACTOR:g} x plan (compile, check, gate)":
                 COMPILE_PLAN_FACTOR * plan,
             f"plan + {LARGEST_TENSOR_FACTOR:g} x largest fp32 tensor (streamed load)":
                 plan + LARGEST_TENSOR_FACTOR * largest}
    if whole_fp32 == "reference":
        parts[f"{REFERENCE_FP32_FACTOR:g} x fp32 (the accuracy reference's model)"] = \
            REFERENCE_FP32_FACTOR * fp32
    elif whole_fp32:
        parts[f"{WHOLE_FP32_FACTOR:g} x fp32 (whole model loaded, then quantized)"] = \
            WHOLE_FP32_FACTOR * fp32
    why, top = max(parts.items(), key=lambda kv: kv[1])
    return MemoryEstimate(params, fp32, plan, largest, FIXED_BYTES + int(top), why,
                          whole_fp32)


def _param_bytes(name: str, ndim: int, weights: str, per: float,
                 keep: tuple[str, ...]) -> float:
    """Bytes per parameter of one tensor in the plan (the embedding is int8 per row when
    quantized; norms and biases stay float32; kept layers keep float32)."""
    if ndim < 2 or weights == "fp32":
        return 4.0
    if "tok_embeddings" in name or "embed" in name:
        return 4.0 if "embed" in keep else (2.0 if weights == "bf16" else 1.0)
    if name.startswith("output.") and "lm_head" in keep:
        return 4.0
    if any(k in name.split(".") for k in keep):
        return 4.0
    return per


def max_memory_override(value: Optional[int]) -> Optional[int]:
    """The memory the build may use: `value` (--max-memory), else $KILN_BUILD_MAX_MEMORY
    (bytes, or 20GiB, 512MiB ...), else None (MemAvailable decides)."""
    if value is not None:
        return value
    raw = os.environ.get(MAX_MEMORY_ENV)
    return parse_bytes(raw, MAX_MEMORY_ENV) if raw else None


def parse_bytes(text: str, what: str) -> int:
    """'20GiB', '512MiB', '1000000' (kv_cache.memory's units) -> bytes; ValueError naming
    `what` otherwise."""
    from kiln.builder.spec import parse_memory

    try:
        kind, value = parse_memory(text.strip())
    except ValueError as e:
        raise ValueError(f"{what}={text!r}: {e}") from None
    if kind != "bytes":
        raise ValueError(f"{what}={text!r}: a size in bytes, e.g. 20GiB")
    return int(value)


def refusal(est: MemoryEstimate, available: Optional[int], source: str) -> Optional[str]:
    """The message refusing a build that cannot fit in `available` bytes (None: it fits, or
    the available memory is unknown). `source` says where `available` came from."""
    if available is None or est.peak_bytes <= available:
        return None
    return (f"this checkpoint is larger than this machine can build: {est.describe()}; "
            f"{gib(available)} available ({source}). Build on a machine with more memory, or "
            f"set --max-memory / {MAX_MEMORY_ENV} to build anyway")


def build_estimate(spec, ckpt) -> MemoryEstimate:
    """The estimate for a build of `spec` on checkpoint `ckpt`. The fp32 model counts whole
    where the build needs it: calibration, or a gated plan whose reference is not cached."""
    from kiln.builder.streaming import streams

    p = spec.precision
    keep = _kept(spec)
    whole = "quantize" if not streams(spec, ckpt.config) else ""
    if not whole and spec.max_ppl_increase is not None:
        from kiln.builder.accuracy_reference import Gate

        from kiln.builder.layerwise_reference import supported

        # the layerwise reference holds one layer's fp32 weights (the embedding's group is
        # the largest: below the streamed load's plan + largest tensor)
        whole = "" if (supported(ckpt.config) or Gate(spec, ckpt).reference_cached()) \
            else "reference"
    return estimate(ckpt.config, p.weights, keep, whole)


def build_refusal(spec, ckpt, max_memory: Optional[int] = None,
                  out: Optional[Path] = None) -> Optional[str]:
    """The refusal of a build of `spec` on checkpoint `ckpt` that cannot fit in the memory it
    may use (max_memory, else $KILN_BUILD_MAX_MEMORY, else MemAvailable), or whose plan
    cannot fit on the disk that is to hold `out`; None when it fits."""
    est = build_estimate(spec, ckpt)
    try:
        limit = max_memory_override(max_memory)
    except ValueError as e:          # a bad $KILN_BUILD_MAX_MEMORY: refused, naming it
        return str(e)
    if limit is not None:
        source = "--max-memory" if max_memory is not None else MAX_MEMORY_ENV
        too_big = refusal(est, limit, source)
    else:
        too_big = refusal(est, mem_available_bytes(), "MemAvailable in /proc/meminfo")
    return too_big or (disk_refusal(est, out) if out is not None else None)


def plan_disk_bytes(spec, ckpt) -> int:
    """The disk a build of `spec` on `ckpt` needs for its plan while it writes it."""
    return disk_need(estimate(ckpt.config, spec.precision.weights, _kept(spec)))


def _kept(spec) -> tuple[str, ...]:
    """The linears a quantized spec keeps in high precision (none for a float plan)."""
    p = spec.precision
    return () if p.weights in ("bf16", "fp32") else tuple(p.keep_high_precision)


# Beside its weights a plan holds its engine (AOTInductor's .so: 3-5 MB from 135M to 8B
# parameters), kernels (about 1 MB) and tokenizer (up to a few MB), and while it is built the
# compiler's object files; the weights' estimate is approximate (a few percent).
PLAN_FILES_BYTES = 64 << 20
PLAN_BYTES_MARGIN = 1.05


def disk_need(est: MemoryEstimate) -> int:
    """The disk a build of `est` needs for its plan while it writes it."""
    return int(est.plan_bytes * PLAN_BYTES_MARGIN) + PLAN_FILES_BYTES


def disk_refusal(est: MemoryEstimate, out: Path) -> Optional[str]:
    """The refusal of a build whose plan cannot fit on the file system that is to hold `out`
    (that of its nearest existing ancestor); None when it fits. An existing plan at `out`
    stays until the new one replaces it, so only the free space counts."""
    d = Path(out).absolute()
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return None
    need = disk_need(est)
    if free >= need:
        return None
    return (f"the plan will not fit on the disk that holds {d}: it needs ~{gib(need)} "
            f"(weights ~{gib(est.plan_bytes)}, engine, kernels and tokenizer) and "
            f"{gib(free)} is free. Free space there, or build with --out on another disk")


# What an out-of-space error says ("No space left on device", "Disk quota exceeded").
DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def disk_full(exc: BaseException) -> Optional[BaseException]:
    """The out-of-space error behind `exc` along its causes, if there is one: an OSError of
    ENOSPC or EDQUOT, or an error that quotes one (a compiler's, a C++ writer's message)."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(t in str(e) for t in DISK_FULL_TEXTS):
            return e
        e = e.__cause__ or e.__context__
    return None
