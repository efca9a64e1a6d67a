"""The builder's memory: what it has used (peak RSS) and what a build will need.

    peak_rss_bytes()                 the process's high-water resident set so far
    estimate(ckpt, spec, streaming)  -> MemoryEstimate   from the tensor index alone
    check_fits(estimate, available)  BuildError-free check: the refusal message, or None

The estimate reads only shapes (the family's parameter shapes, which the source's tensor
index was checked against when the checkpoint was opened): no weight is read.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Optional

GiB = 1 << 30
MAX_MEMORY_ENV = "KILN_BUILD_MAX_MEMORY"

# Builder peak RSS, measured with `kiln build` (VmHWM at the end of the build) on random
# llama checkpoints on the AVX2 build host, W4A8 + int8 KV, accuracy gate on:
#   tiny   (0.9M params, fp32 3.6 MB):   peak 0.9 GiB  -> the fixed part: torch, the
#                                        compiler and the evaluation's activations
#   medium (0.19 GB params, fp32 0.76 GB): see bench/scale.py `measure`
#   1B     (1.24 B params, fp32 4.94 GB): peak 7.9 GB = 1.6 x fp32 (most of it the fp32 model
#                                        the accuracy reference runs, plus the plan's packed
#                                        weights and the compile's copies)
# Loading every tensor in fp32 before quantizing holds the whole fp32 model; the streaming
# load (builder/streaming.py) holds the packed weights plus one fp32 tensor at a time.
FIXED_BYTES = 1 * GiB            # torch + inductor + evaluation activations
FULL_FP32_FACTOR = 1.6           # x fp32 weight bytes, when the fp32 model is held whole
STREAMED_PLAN_FACTOR = 2.0       # x plan bytes: packed weights + the compile's copy of them

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
    peak_bytes: int          # the builder's expected peak RSS
    streaming: bool          # the estimate is for the streaming load

    def describe(self) -> str:
        how = (f"{STREAMED_PLAN_FACTOR:g} x plan" if self.streaming
               else f"{FULL_FP32_FACTOR:g} x fp32 weights")
        return (f"needs ~{gib(self.peak_bytes)}: {self.params / 1e9:.2f} B parameters, "
                f"weights {gib(self.fp32_bytes)} fp32, plan ~{gib(self.plan_bytes)}; "
                f"peak = {how} + {gib(FIXED_BYTES)} fixed")


def estimate(config, weights: str, keep: tuple[str, ...], streaming: bool) -> MemoryEstimate:
    """The estimate for a model config (DecoderConfig) at precision.weights with
    keep_high_precision `keep`; `streaming`: quantized as loaded, no full fp32 model."""
    from kiln.builder.arch.families import param_shapes

    shapes = param_shapes(config)
    params = plan = 0
    per = _BYTES_PER_PARAM.get(weights, 4.0)
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= int(d)
        params += n
        plan += int(n * _param_bytes(name, len(shape), weights, per, keep))
    fp32 = params * 4
    peak = FIXED_BYTES + int(STREAMED_PLAN_FACTOR * plan if streaming
                             else FULL_FP32_FACTOR * fp32)
    return MemoryEstimate(params, fp32, plan, peak, streaming)


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


def build_refusal(spec, config, max_memory: Optional[int] = None) -> Optional[str]:
    """The refusal of a build of `spec` on a model of `config` that cannot fit in the
    memory it may use (max_memory, else $KILN_BUILD_MAX_MEMORY, else MemAvailable); None when
    it fits. A gated plan whose reference runs the float32 model counts the whole model."""
    from kiln.builder.streaming import streams

    p = spec.precision
    keep = () if p.weights in ("bf16", "fp32") else tuple(p.keep_high_precision)
    streamed = streams(spec) and spec.max_ppl_increase is None
    est = estimate(config, p.weights, keep, streamed)
    try:
        limit = max_memory_override(max_memory)
    except ValueError as e:          # a bad $KILN_BUILD_MAX_MEMORY: refused, naming it
        return str(e)
    if limit is not None:
        source = "--max-memory" if max_memory is not None else MAX_MEMORY_ENV
        return refusal(est, limit, source)
    return refusal(est, mem_available_bytes(), "MemAvailable in /proc/meminfo")
