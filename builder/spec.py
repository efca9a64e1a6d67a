"""The spec: what to build, validated once at load.

A spec is user-facing YAML. Every error names the YAML path, the bad value and what is
allowed (see `SpecError`). Unknown keys are rejected everywhere.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.contracts import default_input_len
from kiln.contracts.manifest import LORA_MODULES

WEIGHT_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")
KV_PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp8")
# Weight precisions this build of Kiln knows how to build; the rest are rejected with a
# message that says so (rather than building something else silently).
BUILDABLE_WEIGHTS = ("fp32", "bf16", "int8", "int4", "fp8")
QUANTIZED_WEIGHTS = ("int8", "int4", "fp8")
# Weights the `quant` plugin packs and its kernels multiply in float32: the quantized ones,
# and bf16 (weight-only: bf16 storage, float32 activations, upcast in registers).
PACKED_WEIGHTS = QUANTIZED_WEIGHTS + ("bf16",)
# KV pool dtypes the paged-attention kernels read and write (int8/fp8 with per-token
# scales: plugins/paged_kv/kv_format.py); fp16 has no CPU kernel and is rejected by name.
BUILDABLE_KV = ("fp32", "bf16", "int8", "fp8")
# ... and on GPU targets also fp16 (the Triton kernel, plugins/paged_kv/triton_attention.py)
GPU_ONLY_KV = ("fp16",)
MIN_GPU_SM = 80     # Triton kernels: bf16 / TF32 tensor cores
FP8_MIN_SM = 89     # E4M3 conversions and MMA
# Default accuracy gate (largest relative perplexity increase over the unquantized model)
# per weight precision; chosen from SmolLM2-135M measurements (README "Precisions"): a
# healthy plan passes with margin, a broken one (wrong scales, a bad kernel) fails.
DEFAULT_MAX_PPL_INCREASE = {"bf16": 0.01, "fp16": 0.01, "fp8": 0.05, "int8": 0.03,
                            "int4": 0.15}
# What a quantized KV cache adds to the weights' default (a plan with fp32 weights and an
# int8 cache is gated at the KV share alone).
DEFAULT_KV_PPL_INCREASE = {"int8": 0.02, "fp8": 0.04}

# Known NVIDIA targets by name -> compute capability.
GPU_TARGETS = {
    "a100": "sm_80", "a10": "sm_86", "a10g": "sm_86", "l4": "sm_89", "l40s": "sm_89",
    "h100": "sm_90", "h200": "sm_90", "gh200": "sm_90", "b200": "sm_100",
}


class SpecError(ValueError):
    """A spec that cannot be built. `problems` is a list of (yaml_path, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"invalid spec {source}:"] + [f"  {p}: {m}" for p, m in problems]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RandomArch(_Strict):
    """Architecture of a random-weight model (tests)."""

    vocab_size: int = Field(ge=8, le=1_000_000, description="vocabulary size")
    hidden_size: int = Field(ge=8, le=65536)
    intermediate_size: int = Field(ge=8, le=262144)
    num_hidden_layers: int = Field(ge=1, le=256)
    num_attention_heads: int = Field(ge=1, le=256)
    num_key_value_heads: Optional[int] = Field(default=None, ge=1, le=256)
    head_dim: Optional[int] = Field(default=None, ge=4, le=512)
    max_position_embeddings: int = Field(default=2048, ge=16)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    model_type: Optional[str] = Field(
        default=None, description="the family, as a config.json model_type (qwen3, gemma2, "
        "mixtral, ...); default llama (qwen2 with attention_bias)")
    config: dict[str, Any] = Field(
        default_factory=dict, description="further config.json keys of that family "
        "(e.g. num_local_experts, sliding_window)")

    @model_validator(mode="after")
    def _config_keys_are_new(self):
        clash = sorted(set(self.config) & (set(type(self).model_fields) - {"config"}))
        if clash:
            raise ValueError(f"arch.config repeats the arch field(s) {', '.join(clash)}: "
                             "set them on arch directly")
        return self


class ModelSpec(_Strict):
    source: str = Field(
        description="a HF checkpoint directory, a .gguf file, `pkg://PACKAGE/FILE` (a file "
        "inside an installed Python package), or `random`")
    revision: Optional[str] = Field(
        default=None, description="expected sha256 of the source weights (hex); the build "
        "fails when the weights differ")
    arch: Optional[RandomArch] = Field(default=None, description="architecture for `random`")
    seed: int = Field(default=0, description="seed for `random` weights")
    tokenizer: Optional[str] = Field(
        default=None, description="tokenizer.json for `random` (default: a byte-level "
        "tokenizer generated to the vocab size)")

    @model_validator(mode="after")
    def _random_needs_arch(self):
        if self.source == "random" and self.arch is None:
            raise ValueError("source `random` needs `arch` (an architecture config)")
        if self.source != "random" and self.arch is not None:
            raise ValueError("`arch` is only for source `random`; a checkpoint brings its own")
        return self


class TargetSpec(_Strict):
    device: str = Field(default="cpu", description="cpu, a GPU name (h100, h200, a100, "
                        "l40s, ...) or a compute capability sm_XY")
    backend: Literal["aoti", "eager"] = Field(default="aoti", description="aoti "
                                              "(AOTInductor, default) or eager (debugging)")
    isa: str = Field(
        default="auto", description="CPU vector ISA the plan's code is compiled for: auto (the "
        "highest this build machine runs), none (scalar), avx2, avx512, avx512_vnni, "
        "avx512_bf16, amx. A plan runs on any machine with the CPU features it records; "
        "build for the serving fleet's level when it is below the build machine's")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        v = v.strip().lower()
        if v == "cpu" or v in GPU_TARGETS:
            return v
        if v.startswith("sm_") and v[3:].isdigit() and len(v) >= 5:
            return v
        raise ValueError(f"unknown device {v!r}; allowed: cpu, {', '.join(GPU_TARGETS)}, "
                         "or a compute capability like sm_90")

    @field_validator("isa")
    @classmethod
    def _isa(cls, v: str) -> str:
        from kiln.plugins import isa

        v = v.strip().lower()
        if v != isa.AUTO and v not in isa.LEVEL_NAMES:
            raise ValueError(f"unknown CPU ISA {v!r}; allowed: {isa.AUTO}, "
                             f"{', '.join(isa.LEVEL_NAMES)}")
        return v

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def compute_capability(self) -> Optional[str]:
        if not self.is_gpu:
            return None
        return GPU_TARGETS.get(self.device, self.device)


class PrecisionSpec(_Strict):
    weights: Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"] = "fp32"
    group_size: Optional[Literal[32, 64, 128]] = Field(
        default=None, description="int4 group size (32, 64, 128); default: the largest that "
        "divides every quantized layer's input width (recorded in the plan)")
    kv_cache: Optional[Literal["fp32", "bf16", "fp16", "int8", "fp8"]] = Field(
        default=None, description="KV pool dtype; default: fp32 for fp32 weights, else bf16")
    activations: Literal["fp32", "bf16", "fp16", "fp8", "int8"] = Field(
        default="fp32", description="activation dtype of the matmuls; int8 (CPU): with int8 "
        "weights W8A8, each token's activations quantized to int8 at run time (per-token "
        "scale) and multiplied with int8 dot products (AVX-512 VNNI / AVX2); with int4 "
        "weights W4A8, activations quantized per group of 32 (llama.cpp's Q4_1 x Q8_1)")
    keep_high_precision: tuple[str, ...] = Field(
        default=("embed", "lm_head"),
        description="layers that keep the unquantized float dtype in a quantized plan: "
        "embed, lm_head, or module names (w2, layers.0). An embedding or lm_head left out is "
        "stored int8 per row (the lm_head in the plan's scheme). int8/int4/fp8 only: a bf16 "
        "plan stores every weight bf16")


class LimitsSpec(_Strict):
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_seq_len: int = Field(default=2048, ge=16, le=1_048_576)
    max_input_len: Optional[int] = Field(default=None, ge=1, description="default: max_seq_len - 1")
    max_num_tokens: int = Field(default=512, ge=1, le=1_048_576,
                                description="tokens per engine step (chunked-prefill budget)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_input_len is not None and self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be below max_seq_len "
                             f"({self.max_seq_len}): a request needs room for one output token")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) must be at least "
                             f"max_batch_size ({self.max_batch_size}): each running sequence "
                             "needs one token per step")
        return self

    @property
    def input_len(self) -> int:
        return (self.max_input_len if self.max_input_len is not None
                else default_input_len(self.max_seq_len))


class KVCacheSpec(_Strict):
    tokens_per_block: Literal[8, 16, 32, 64] = 16
    memory: Union[int, float, str] = Field(
        default="256MiB", description="KV pool budget: bytes (int or '512MiB'/'2GiB') or a "
        "fraction of free memory in (0, 1]")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v):
        parse_memory(v)  # raises on bad input
        return v


class SchedulerSpec(_Strict):
    policy: Literal["guaranteed_no_evict", "max_utilization"] = "max_utilization"
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_queue: int = Field(default=1024, ge=1, description="bound of the waiting queue")


class SpeculativeSpec(_Strict):
    method: Literal["ngram", "draft"] = Field(
        description="ngram: prompt lookup, drafts copied from earlier in the prompt and output; "
        "draft: a second, cheaper plan of the same tokenizer proposes them (draft_plan)")
    draft_plan: Optional[str] = Field(default=None, description="method draft: the built plan "
                                      "directory that drafts (relative to the spec file, or "
                                      "absolute)")
    max_draft_tokens: int = Field(default=4, ge=1, le=32, description="drafts per sequence "
                                  "per step (k)")
    ngram_min: int = Field(default=1, ge=1, le=16, description="shortest suffix looked up")
    ngram_max: int = Field(default=4, ge=1, le=16, description="longest suffix looked up")
    max_batch: int = Field(default=4, ge=1, description="speculate only in steps with at most "
                           "this many decoding sequences")

    @model_validator(mode="after")
    def _ngram_range(self):
        if (self.method == "draft") != (self.draft_plan is not None):
            raise ValueError("draft_plan is required with method draft, and only with it")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be at most ngram_max "
                             f"({self.ngram_max})")
        return self


class LoraSpec(_Strict):
    max_rank: int = Field(ge=1, le=256, description="highest adapter rank the plan serves "
                          "(lower ranks are zero-padded to it)")
    target_modules: tuple[str, ...] = Field(
        default=LORA_MODULES, min_length=1, description="the decoder layers' linears an "
        f"adapter may change, by PEFT's names: {', '.join(LORA_MODULES)}")
    max_adapters_per_batch: int = Field(default=4, ge=1, le=64, description="different "
                                        "adapters in one engine step (requests of more wait)")
    max_cpu_adapters: int = Field(default=16, ge=1, description="adapters loaded at once")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="how the step holds the adapters' A and B: bfloat16 "
        "halves the bytes each step reads (the LoRA terms' cost), float32 keeps PEFT's "
        "float32 weights exactly")

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in v if m not in LORA_MODULES]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a LoRA target; allowed: "
                             f"{', '.join(LORA_MODULES)}")
        if len(set(v)) != len(v):
            raise ValueError(f"{list(v)} names a module twice")
        return tuple(m for m in LORA_MODULES if m in v)       # the step's one order

    @model_validator(mode="after")
    def _residency(self):
        if self.max_cpu_adapters < self.max_adapters_per_batch:
            raise ValueError(f"max_cpu_adapters ({self.max_cpu_adapters}) must be at least "
                             f"max_adapters_per_batch ({self.max_adapters_per_batch})")
        return self


class AccuracySpec(_Strict):
    max_ppl_increase: Optional[float] = Field(
        default=None, ge=0, description="largest relative perplexity increase over the "
        "unquantized model (0.05 = 5%); default per precision")
    eval_tokens: Optional[int] = Field(default=None, ge=256, description="evaluation "
                                       "tokens; default by model size (eval_tokens_for)")
    calibration_text: Optional[str] = Field(default=None, description="text for AWQ-style "
                                            "int4 calibration (`pydoc` = Python's docs)")


EVAL_TOKENS = 20480                # the gate's default evaluation tokens, up to ...
EVAL_TOKENS_FULL_PARAMS = 1.5e9    # ... this many parameters; fewer in proportion above
EVAL_TOKENS_FLOOR = 2048


def eval_tokens_for(accuracy: AccuracySpec, params: int) -> int:
    """The accuracy gate's evaluation tokens: accuracy.eval_tokens, else by model size. The
    gate's two passes (the reference, the compiled plan) cost tokens x parameters, so past
    1.5 B parameters the default shrinks in proportion, in whole 256s and never below 2048:
    20480 up to 1.5 B, 9472 at 3.2 B (Llama 3.2 3B), 3584 at 8 B, 2048 from 15 B."""
    if accuracy.eval_tokens is not None:
        return accuracy.eval_tokens
    if params <= EVAL_TOKENS_FULL_PARAMS:
        return EVAL_TOKENS
    scaled = int(EVAL_TOKENS * EVAL_TOKENS_FULL_PARAMS / params) // 256 * 256
    return max(EVAL_TOKENS_FLOOR, scaled)


class GoldenPrompt(_Strict):
    prompt: str
    expected: Optional[str] = None
    chat: bool = False
    max_tokens: int = Field(default=16, ge=1)


class Spec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                      description="plan name: letters, digits, . _ -")
    model: ModelSpec
    target: TargetSpec = TargetSpec()
    precision: PrecisionSpec = PrecisionSpec()
    limits: LimitsSpec = LimitsSpec()
    kv_cache: KVCacheSpec = KVCacheSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    speculative: Optional[SpeculativeSpec] = None
    lora: Optional[LoraSpec] = None
    accuracy: AccuracySpec = AccuracySpec()
    golden: tuple[GoldenPrompt, ...] = ()
    golden_agreement: Optional[float] = Field(
        default=None, ge=0, le=1, description="kiln ci: least fraction of greedy tokens "
        "(golden prompts, or a default prompt) that must equal the previous plan's")

    @model_validator(mode="after")
    def _buildable(self):
        if self.precision.weights not in BUILDABLE_WEIGHTS:
            raise _PathError("precision.weights", f"{self.precision.weights!r} is not built "
                             f"by this version of kiln; allowed: {', '.join(BUILDABLE_WEIGHTS)}")
        if self.precision.kv_cache is not None and self.precision.kv_cache not in BUILDABLE_KV \
                and not (self.target.is_gpu and self.precision.kv_cache in GPU_ONLY_KV):
            raise _PathError("precision.kv_cache", f"{self.precision.kv_cache!r} is not built "
                             f"by this version of kiln (no paged-attention kernel reads it); "
                             f"allowed: {', '.join(BUILDABLE_KV)}")
        if self.precision.group_size is not None and self.precision.weights != "int4":
            raise _PathError("precision.group_size", "group_size applies to int4 weights only "
                             f"(weights is {self.precision.weights!r})")
        if (self.precision.weights in ("bf16", "fp32") and self.precision.keep_high_precision
                != PrecisionSpec.model_fields["keep_high_precision"].default):
            raise _PathError("precision.keep_high_precision", "applies to int8, int4 and fp8 "
                             f"weights; a {self.precision.weights} plan stores every weight "
                             f"{self.precision.weights}")
        if self.accuracy.calibration_text is not None and self.precision.weights != "int4" \
                and self.precision.activations != "int8":
            raise _PathError("accuracy.calibration_text", "calibration applies to int4 weights "
                             "(AWQ-style scales) and int8 activations (SmoothQuant) only "
                             f"(weights is {self.precision.weights!r})")
        if self.precision.activations == "fp8":
            cc = self.target.compute_capability
            if cc is None or int(cc[3:]) < 89:
                raise _PathError("precision.activations", f"fp8 activations need a GPU with "
                                 f"FP8 (sm_89 or newer); target is {self.target.device!r}")
        if self.precision.activations == "int8" and (self.precision.weights not in ("int8", "int4")
                                                     or self.target.is_gpu):
            raise _PathError("precision.activations", "int8 activations (W8A8 / W4A8) need "
                             f"int8 or int4 weights on a cpu target (weights is "
                             f"{self.precision.weights!r}, device {self.target.device!r})")
        if self.precision.activations == "int8" and self.precision.weights == "int4":
            if self.precision.group_size not in (None, 32):
                raise _PathError("precision.group_size", "int4 weights with int8 activations "
                                 "(W4A8) use groups of 32 (each with its activations' own "
                                 f"scale); got {self.precision.group_size}: remove group_size "
                                 "or set 32")
            if self.accuracy.calibration_text is not None:
                raise _PathError("accuracy.calibration_text", "W4A8 (int4 weights, int8 "
                                 "activations) quantizes round-to-nearest with group minimums "
                                 "(a Q4_1 GGUF's weights exactly); calibration applies to int4 "
                                 "weight-only (AWQ) and W8A8 (SmoothQuant): remove it")
        if self.target.is_gpu and self.target.isa != "auto":
            raise _PathError("target.isa", f"{self.target.isa!r}: the CPU ISA applies to cpu "
                             f"targets; target.device is {self.target.device!r} (leave isa auto)")
        if self.target.is_gpu:
            _check_gpu_precision(self)
        sp, lim = self.speculative, self.limits
        if sp is not None:
            batch = min(sp.max_batch, lim.max_batch_size)
            if lim.max_num_tokens < batch * (sp.max_draft_tokens + 1):
                raise _PathError("speculative.max_draft_tokens", f"{batch} speculating "
                                 f"sequences (min of speculative.max_batch, "
                                 f"limits.max_batch_size) x (max_draft_tokens "
                                 f"{sp.max_draft_tokens} + 1) = "
                                 f"{batch * (sp.max_draft_tokens + 1)} tokens exceed "
                                 f"limits.max_num_tokens ({lim.max_num_tokens}): raise "
                                 "max_num_tokens or lower max_draft_tokens or max_batch")
        return self

    @property
    def quantized(self) -> bool:
        return self.precision.weights in QUANTIZED_WEIGHTS

    @property
    def packed_weights(self) -> bool:
        """Linears run the `quant` plugin's kernels (int8/int4/fp8, weight-only bf16, and on
        the CPU fp32: its streaming GEMV reads weights about twice as fast as BLAS's sgemv)."""
        return self.precision.weights in PACKED_WEIGHTS or (
            self.precision.weights == "fp32" and not self.target.is_gpu)

    @property
    def max_ppl_increase(self) -> Optional[float]:
        """The accuracy gate's limit; None: no gate (fp32 weights and a float KV cache, unless
        the spec sets one). Defaults add up: the weights' share plus the KV cache's."""
        if self.accuracy.max_ppl_increase is not None:
            return self.accuracy.max_ppl_increase
        parts = [DEFAULT_MAX_PPL_INCREASE.get(self.precision.weights),
                 DEFAULT_KV_PPL_INCREASE.get(self.kv_dtype)]
        parts = [p for p in parts if p is not None]
        return round(sum(parts), 6) if parts else None

    @property
    def kv_dtype(self) -> str:
        if self.precision.kv_cache:
            return self.precision.kv_cache
        return "fp32" if self.precision.weights == "fp32" else "bf16"

    def canonical(self) -> dict:
        """The resolved spec as plain data, defaults filled in (stable for hashing)."""
        data = self.model_dump(mode="json")
        for key in ("golden_agreement", "speculative", "lora"):   # added later: unset keeps old
            if data[key] is None:                          # fingerprints
                del data[key]
        if data["accuracy"]["eval_tokens"] is None:      # by model size (eval_tokens_for)
            del data["accuracy"]["eval_tokens"]
        if data.get("speculative", {}).get("draft_plan", 0) is None:
            del data["speculative"]["draft_plan"]
        return data

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def _check_gpu_precision(spec: "Spec") -> None:
    """What a compute capability cannot run is refused here, before any build work: Kiln's
    Triton kernels need sm_80 (bf16 and TF32 tensor cores), and E4M3 needs sm_89."""
    cc = spec.target.compute_capability
    sm = int(cc[3:])
    if sm < MIN_GPU_SM:
        raise _PathError("target.device", f"{spec.target.device!r} is {cc}; Kiln's GPU kernels "
                         f"need sm_{MIN_GPU_SM} or newer (A100, A10, L4, L40S, H100, H200, "
                         "B200); allowed: " + ", ".join(GPU_TARGETS) + " or sm_80 and up")
    if sm >= FP8_MIN_SM:
        return
    fp8 = f"needs a GPU with FP8 (sm_{FP8_MIN_SM} or newer: L4, L40S, H100, H200); target " \
          f"{spec.target.device!r} is {cc}"
    if spec.precision.weights == "fp8":
        raise _PathError("precision.weights", f"fp8 (E4M3) {fp8}; use int8 or bf16 weights, or "
                         "an FP8 GPU")
    if spec.kv_dtype == "fp8":
        raise _PathError("precision.kv_cache", f"an fp8 (E4M3) KV cache {fp8}; use int8 or "
                         "bf16")


class _PathError(ValueError):
    """A cross-field error that knows its YAML path."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message)


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(v) -> tuple[str, float]:
    """('bytes', n) or ('fraction', f) for a kv_cache.memory value; ValueError if bad."""
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not a memory size; use bytes ('512MiB') or a fraction")
    if isinstance(v, int):
        if v <= 0:
            raise ValueError(f"{v} bytes: must be positive")
        return ("bytes", v)
    if isinstance(v, float):
        if not 0 < v <= 1:
            raise ValueError(f"{v}: a fraction of free memory must be in (0, 1]")
        return ("fraction", v)
    s = str(v).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _UNITS or not num:
        raise ValueError(f"{v!r} is not a memory size; use e.g. 536870912, '512MiB', '2GiB' "
                         "or a fraction like 0.5")
    n = float(num) * _UNITS[unit]
    if n <= 0:
        raise ValueError(f"{v!r}: must be positive")
    return ("bytes", int(n))


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _describe(err: dict) -> str:
    t, msg, inp = err["type"], err["msg"], err.get("input")
    if t == "extra_forbidden":
        return f"unknown key (value {inp!r}); check the spelling against DESIGN.md's spec"
    if t == "missing":
        return "required key is missing"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if t == "literal_error":
        return f"{inp!r} is not allowed; {msg[0].lower() + msg[1:]}"
    return f"{msg} (got {inp!r})"


def load_spec(path: str | os.PathLike) -> Spec:
    """Read and validate a spec file; raises SpecError naming every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(str(path), [("(file)", f"cannot read: {e.strerror or e}")]) from None
    return parse_spec(text, str(path), base_dir=path.parent)


def parse_spec(text: str, source: str = "<spec>", base_dir: Path | None = None) -> Spec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(source, [("(yaml)", f"not valid YAML: {e}")]) from None
    if not isinstance(data, dict):
        raise SpecError(source, [("(top level)", f"a spec is a mapping, got {type(data).__name__}")])
    # Relative local paths in model.source/tokenizer are relative to the spec file.
    model = data.get("model")
    if base_dir is not None and isinstance(model, dict):
        for key in ("source", "tokenizer"):
            val = model.get(key)
            if isinstance(val, str) and val not in ("random",) and "://" not in val \
                    and not os.path.isabs(os.path.expanduser(val)):
                model[key] = str((base_dir / val).resolve())
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _PathError):
                problems.append((ctx_err.path, str(ctx_err)))
            else:
                problems.append((_loc(err["loc"]), _describe(err)))
        raise SpecError(source, problems) from None


def default_output(spec: Spec) -> Path:
    """Where `kiln build` writes a spec's plan when no output is given: plans/NAME."""
    return Path("plans") / spec.name
