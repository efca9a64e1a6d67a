"""The plan manifest (`plan.json`): one typed, versioned contract between builder and runtime.

    spec (YAML) --builder/build.py--> PlanManifest --to_json--> plan.json
    plan.json --runtime/plan.read_manifest--> PlanManifest.from_json --> runtime

One writer (builder/build.py `_build_into` builds it; the engine section once, before the
build runs the compiled step) and one reader (runtime/plan.py `read_manifest`). The JSON on
disk is the dict `to_json` returns; `from_json(d).to_json() == d` for every manifest kiln
writes. `from_json` validates every field and raises ManifestError naming the bad one
(`limits.max_seq_len`, `files["engine.pt2"].sha256`).

Torch-free, stdlib only: the builder's quick up-to-date check and `kiln inspect` read it
without importing torch.

Two sections stay open dicts because their schema lives with their writer: `spec` (the
resolved spec, builder/spec.py `Spec.canonical()`; `PlanManifest.golden` and the properties
beside it are typed views of what the runtime reads from it) and `model.config` (the
architecture's config, builder/arch `DecoderConfig.to_dict()`; ModelSection.shape is its typed
view).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from kiln.contracts import PLAN_FORMAT_VERSION, FieldError


class ManifestError(FieldError):
    """A manifest field that is missing, unknown or of the wrong type.

    field: its path in plan.json (`engine.kernels[0]`); problem: what is wrong with it."""

    def __init__(self, field: str, problem: str):
        super().__init__(field, problem, f"{field}: {problem}")


# ---- generic (de)serialization of the frozen sections ---------------------------------------

def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _from_json(hint, value, path: str):
    """`value` (from JSON) checked against `hint` and converted (lists -> tuples, objects ->
    sections); ManifestError naming `path` otherwise."""
    if hint is Any:
        return value
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _from_json(option, value, path)
            except ManifestError:
                if len(options) == 1:
                    raise
        raise ManifestError(path, f"expected {' or '.join(map(_type_name, options))}, got "
                                  f"{type(value).__name__} {value!r:.60}")
    if isinstance(hint, type) and issubclass(hint, _Section):
        return hint._from_dict(value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise ManifestError(path, f"expected a list, got {type(value).__name__}")
        return tuple(_from_json(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ManifestError(path, f"expected an object, got {type(value).__name__}")
        if origin is None:
            return value
        return {k: _from_json(args[1], v, f'{path}["{k}"]') for k, v in value.items()}
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ManifestError(path, f"expected {_type_name(hint)}, got {type(value).__name__} "
                                  f"{value!r:.60}")
    return value


def _to_json(value):
    if isinstance(value, _Section):
        return value.to_json()
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


class _Section:
    """A frozen dataclass that reads itself from a JSON object, field by field."""

    @classmethod
    def from_json(cls, d, path: str = ""):
        """The section from its JSON object (path: where it sits, for ManifestError)."""
        return cls._from_dict(d, path)

    @classmethod
    def _from_dict(cls, d, path: str):
        if not isinstance(d, dict):
            raise ManifestError(path or "plan.json", f"expected an object, got "
                                                     f"{type(d).__name__}")
        hints = get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            where = f"{path}.{unknown[0]}" if path else unknown[0]
            raise ManifestError(where, f"unknown field; {cls.__name__} has "
                                       f"{', '.join(names)}")
        values = {}
        for f in dataclasses.fields(cls):
            where = f"{path}.{f.name}" if path else f.name
            if f.name not in d:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ManifestError(where, "missing")
                continue
            values[f.name] = _from_json(hints[f.name], d[f.name], where)
        obj = cls(**values)
        obj._validate(path)
        return obj

    def _validate(self, path: str) -> None:
        """Checks across fields (after every field has its type)."""

    def to_json(self) -> dict:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}


# ---- the sections -------------------------------------------------------------------------

@dataclass(frozen=True)
class FileEntry(_Section):
    """files[rel]: one file of the plan directory, as built."""
    size: int          # bytes
    sha256: str        # hex digest of its bytes


@dataclass(frozen=True)
class ModelShape:
    """The typed view of model.config the runtime sizes its KV pools and logits with."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class ModelSection(_Section):
    """model: what was compiled."""
    family: str                    # HF model_type / GGUF arch (builder/arch/families.py)
    config: dict                   # builder/arch DecoderConfig.to_dict(); typed view: .shape
    num_parameters: int
    source: str                    # for a person: "random seed 0", a path, a GGUF
    source_path: Optional[str]     # the checkpoint on the build machine (None: random)
    weights_digest: str            # sha256 over the source weights (a fingerprint input)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**{f.name: self.config[f.name]
                             for f in dataclasses.fields(ModelShape)})

    def _validate(self, path: str) -> None:
        for f in dataclasses.fields(ModelShape):
            _from_json(int, self.config.get(f.name), f"{path}.config.{f.name}")


@dataclass(frozen=True)
class TargetSection(_Section):
    """target: the machine the compiled code is for (the runtime refuses others)."""
    device: str                              # cpu | a GPU name
    arch: str                                # platform.machine() of the build: x86_64 ...
    isa: str                                 # kiln ISA level (plugins/isa.py); GPU: "none"
    isa_flags: tuple[str, ...] = ()          # compiler flags of that level
    cpu_features: Optional[tuple[str, ...]] = None   # CPU features the code needs
    compute_capability: Optional[str] = None         # sm_90 ... (GPU targets)

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"


@dataclass(frozen=True)
class ToolchainSection(_Section):
    """toolchain: what built the plan (compiled engines run only on the torch they were
    built with)."""
    kiln: str
    torch: str
    python: str
    ops: Optional[str] = None   # digest of the kernel ops' schemas (plugins/shims.ops_abi);
                                # None: a plan from before it was recorded


@dataclass(frozen=True)
class QuantizationRecord(_Section):
    """precision.quantization: what the quantizer did (builder/quantize.py quantize_model).

    Weights that are not packed record only `weights` and `scheme` (None). A packed record
    always has the fields down to `bytes_after` (group_size and group_size_source possibly
    null); the ones after are written only when set, so plan.json keeps the keys it had."""
    weights: str                                  # the spec's precision.weights
    scheme: Optional[str]                         # the linears' format (formats.SCHEMES,
                                                  # int4_a8: the interleaved one); None: unpacked
    group_size: Optional[int] = None              # int4 / int4_a8 group; None otherwise
    group_size_source: Optional[str] = None       # spec | auto (int4); None otherwise
    method: Optional[str] = None                  # none | rtn | awq | smoothquant
    activations: Optional[str] = None             # float | int8-per-token-dynamic |
                                                  # int8-per-group-32-dynamic
    kept: Optional[tuple[str, ...]] = None        # keep_high_precision, sorted
    quantized: Optional[tuple[str, ...]] = None   # modules swapped, in order
    awq_alpha: Optional[dict[str, float]] = None  # linear -> the AWQ search's alpha
    embedding: Optional[str] = None               # float | bf16 | fp32 | int8-per-row
    bytes_before: Optional[int] = None            # the swapped modules' weights, float
    bytes_after: Optional[int] = None             # the same, packed (a shared table once)
    smooth_alpha: Optional[dict[str, float]] = None   # linear -> SmoothQuant's alpha (W8A8)
    lm_head: Optional[str] = None                 # how a tied head was stored
    int4_layout_kept: Optional[tuple[str, ...]] = None  # int4 linears left in [N, K/2]
    fp8_compute: Optional[str] = None             # how the fp8 kernel computes
    bf16_compute: Optional[str] = None            # upcast-fp32 | bf16-from-8-rows
    calibration: Optional[str] = None             # why calibration text went unused

    def to_json(self) -> dict:
        out = {k: v for k, v in super().to_json().items() if v is not None}
        out["scheme"] = self.scheme
        if self.scheme is not None:
            out.setdefault("group_size", None)
            out.setdefault("group_size_source", None)
        return out


@dataclass(frozen=True)
class PrecisionSection(_Section):
    """precision: the dtypes the plan computes in."""
    weights: str          # fp32 | bf16 | fp16 | fp8 | int8 | int4
    kv_cache: str         # the KV pool dtype (plugins/paged_kv/kv_format)
    activations: str
    quantization: QuantizationRecord   # the quantizer's report


@dataclass(frozen=True)
class LimitsSection(_Section):
    """limits: what the engine was compiled for; lowered at load, never raised."""
    max_batch_size: int   # sequences per step
    max_seq_len: int      # prompt + output tokens of one sequence
    max_input_len: int    # prompt tokens
    max_num_tokens: int   # tokens per step (the chunked-prefill budget)

    def _validate(self, path: str) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ManifestError(f"{path}.{f.name}", f"{getattr(self, f.name)} is below 1")
        if self.max_input_len >= self.max_seq_len:
            raise ManifestError(f"{path}.max_input_len", f"{self.max_input_len} leaves no room "
                                f"for an output token in max_seq_len {self.max_seq_len}")


# The orders a KV pool may store its [block, token, kv head] rows in (kv_format.new_pools).
POOL_ORDERS = ("block_token_head", "block_head_token")


@dataclass(frozen=True)
class KVCacheSection(_Section):
    """kv_cache: the paged KV pool's layout and the memory it may take at load."""
    tokens_per_block: int
    dtype: str
    memory: Union[int, float, str]      # as the spec wrote it
    budget_bytes: Optional[int]         # one of these two is set
    budget_fraction: Optional[float]    # of the memory available at load
    # the order the pools store [block, token, kv head] in (plugins/paged_kv/kv_format.py):
    # the engine was captured on pools of this order and its kernels read them so; plans
    # that do not record it predate the heads-apart order
    pool_order: str = "block_token_head"

    def _validate(self, path: str) -> None:
        if (self.budget_bytes is None) == (self.budget_fraction is None):
            raise ManifestError(f"{path}.budget_bytes", "exactly one of budget_bytes and "
                                "budget_fraction must be set")
        if self.pool_order not in POOL_ORDERS:
            raise ManifestError(f"{path}.pool_order", f"{self.pool_order!r} is not one of "
                                f"{', '.join(POOL_ORDERS)}")


@dataclass(frozen=True)
class SchedulerSection(_Section):
    """scheduler: the in-flight batching settings (plugins/inflight_batching SchedulerConfig)."""
    policy: str            # guaranteed_no_evict | max_utilization
    chunked_prefill: bool
    prefix_caching: bool
    max_queue: int         # bound of the waiting queue


@dataclass(frozen=True)
class DraftRecord(_Section):
    """speculative.draft: the plan that drafts for this one (method draft), as checked at
    build. The runtime loads it beside this plan and refuses one of another fingerprint."""
    name: str               # the draft plan's name
    fingerprint: str        # the draft plan's fingerprint when this plan was built
    path: str               # its directory, relative to this plan's (or absolute)


@dataclass(frozen=True)
class SpeculativeSection(_Section):
    """speculative: speculative decoding (runtime/speculative.py). The step needs nothing
    new: a sequence's row carries its drafts, with logits at each."""
    method: str             # ngram | draft
    max_draft_tokens: int   # drafts per sequence per step
    ngram_min: int          # shortest suffix looked up (ngram)
    ngram_max: int          # longest suffix looked up (ngram)
    max_batch: int          # speculate only in steps with at most this many decodes
    draft: Optional[DraftRecord] = None   # the draft plan (method draft only)

    def _validate(self, path: str) -> None:
        if self.method not in ("ngram", "draft"):
            raise ManifestError(f"{path}.method", f"{self.method!r}; this kiln knows ngram "
                                "and draft")
        if (self.method == "draft") != (self.draft is not None):
            raise ManifestError(f"{path}.draft", "is required with method draft, and only "
                                "with it")
        if not 1 <= self.ngram_min <= self.ngram_max or min(self.max_draft_tokens,
                                                              self.max_batch) < 1:
            raise ManifestError(path, "needs 1 <= ngram_min <= ngram_max, max_draft_tokens "
                                ">= 1 and max_batch >= 1")

    def to_json(self) -> dict:
        data = super().to_json()
        if data["draft"] is None:      # an n-gram plan is written as before
            del data["draft"]
        return data


# The linear modules of a decoder layer an adapter may target, by PEFT's names.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSection(_Section):
    """lora: the plan's step takes per-token adapter slots and stacked adapter weights as
    inputs (runtime/lora.py), so adapters are loaded and swapped without a rebuild."""
    max_rank: int                        # R: every adapter is zero-padded to it
    target_modules: tuple[str, ...]      # LORA_MODULES the step adds a LoRA term to, in order
    max_adapters_per_batch: int          # S: adapter slots of one step
    max_cpu_adapters: int                # adapters loaded at once
    in_features: dict[str, int]          # module -> its input width
    out_features: dict[str, int]         # module -> its output width
    dtype: str = "float32"               # the stacked A and B: float32 | bfloat16

    def _validate(self, path: str) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ManifestError(f"{path}.dtype", f"{self.dtype!r}; float32 or bfloat16")
        bad = [m for m in self.target_modules if m not in LORA_MODULES]
        if bad or not self.target_modules:
            raise ManifestError(f"{path}.target_modules", f"{list(self.target_modules)}; "
                                f"this kiln knows {', '.join(LORA_MODULES)}")
        if set(self.in_features) != set(self.target_modules) or \
                set(self.out_features) != set(self.target_modules):
            raise ManifestError(path, "in_features and out_features must name exactly the "
                                "target modules")
        if min(self.max_rank, self.max_adapters_per_batch, self.max_cpu_adapters) < 1:
            raise ManifestError(path, "max_rank, max_adapters_per_batch and max_cpu_adapters "
                                "must be >= 1")


@dataclass(frozen=True)
class WeightTensor(_Section):
    """engine.weights.tensors[fqn]: one constant of the compiled engine in the weights file."""
    offset: int                # byte offset of its first element in the file
    dtype: str                 # torch dtype name (float32, bfloat16, int8, ...)
    shape: tuple[int, ...]
    stride: tuple[int, ...]    # in elements, as the compiled code expects them

    def _validate(self, path: str) -> None:
        if len(self.shape) != len(self.stride):
            raise ManifestError(f"{path}.stride", f"has {len(self.stride)} entries for a shape "
                                                  f"of {len(self.shape)}")


@dataclass(frozen=True)
class WeightsSection(_Section):
    """engine.weights: the engine's constants, a file of their own that the runtime maps
    (runtime/weights.py) rather than the compiled code's own copy."""
    file: str                          # relative to the plan directory; listed in files
    tensors: dict[str, WeightTensor]   # fully qualified name -> where its bytes are


@dataclass(frozen=True)
class EngineSection(_Section):
    """engine: the compiled step and what must be loaded before it."""
    backend: str                     # aoti | eager
    file: str                        # the engine, relative to the plan directory
    kernels: tuple[str, ...]         # the plugins' libraries, loaded before the engine
    plugins: tuple[str, ...]         # whose ops the engine calls (imported before it loads)
    kernel_paths: dict[str, str]     # library -> the code path it was compiled to
    inputs: tuple[str, ...]          # the engine-step inputs, in order (DESIGN.md)
    # CPU aoti plans: the weights, mapped at load (None: inside the engine file: GPU, eager)
    weights: Optional[WeightsSection] = None

    def to_json(self) -> dict:
        d = super().to_json()
        if d["weights"] is None:     # weights inside the engine file: not written
            del d["weights"]
        return d


@dataclass(frozen=True)
class CheckSection(_Section):
    """check: the compiled step against the eager model at build time."""
    max_logit_diff: float
    tolerance: float


@dataclass(frozen=True)
class AccuracyRecord(_Section):
    """accuracy: the build's accuracy gate (builder/accuracy_reference.py Gate.record), which
    `kiln verify` re-runs (runtime/accuracy_gate.py rerun_gate) against the same tokens and
    reference. Its first seven fields are the gate's score (kiln.contracts.reports.GateScore)."""
    ppl: float                 # the compiled plan's perplexity on the evaluation tokens
    ref_ppl: float             # the unquantized eager model's
    ppl_increase: float        # ppl / ref_ppl - 1
    max_ppl_increase: float    # the spec's limit
    top1_agreement: float      # fraction of positions whose argmax matches the reference's
    tokens: int                # positions scored
    passed: bool               # ppl_increase <= max_ppl_increase
    text: str                  # the evaluation text's name (runtime/accuracy_gate.py eval_text)
    text_sha256: str
    eval_tokens: int           # tokens taken from it
    ids_sha256: str
    window: int                # tokens per evaluation window
    method: str
    reference: str
    reference_top1: str        # the reference's top-1 predictions, a file of the plan
    reference_cached: bool


@dataclass(frozen=True)
class BuildRecord(_Section):
    """build: what building the plan took (builder/memory.py), for sizing build machines."""
    peak_rss_bytes: int        # the builder's peak resident set when plan.json was written
    plan_bytes: int            # the plan's files, plan.json aside
    streamed: bool             # weights quantized as loaded (no whole fp32 model held)


@dataclass(frozen=True)
class GoldenPrompt:
    """A prompt `kiln verify` completes greedily: one of the spec's `golden` entries (read
    from the recorded spec, builder/spec.py), or its default smoke prompt."""
    prompt: str
    chat: bool = False              # sent as one user message through the chat template
    max_tokens: int = 16            # tokens generated
    expected: Optional[str] = None  # the exact completion required (None: any)
    default: bool = False           # kiln verify's smoke prompt (the spec has none)

    @classmethod
    def from_json(cls, d: dict) -> "GoldenPrompt":
        """One entry of the recorded spec's `golden` list."""
        return cls(prompt=d["prompt"], chat=bool(d.get("chat")),
                   max_tokens=int(d.get("max_tokens") or 16), expected=d.get("expected"))

    @property
    def key(self) -> str:
        """How this prompt's output is matched with the same prompt's from another plan."""
        return f"{'chat' if self.chat else 'text'}|{self.max_tokens}|{self.prompt}"


@dataclass(frozen=True)
class PlanManifest(_Section):
    """plan.json: everything the runtime needs to know about a plan, nothing it must guess."""
    format_version: int
    name: str
    fingerprint: str                 # same fingerprint = same plan (builder/fingerprint.py)
    fingerprint_inputs: dict         # what the fingerprint hashed (kiln ci diffs it)
    quick_key: Optional[str]         # builder/uptodate.py: the torch-free up-to-date check
    created_at: str                  # UTC, ISO 8601
    spec_path: Optional[str]         # the spec it was built from (for rebuild commands)
    spec: dict                       # the resolved spec (builder/spec.py Spec.canonical())
    model: ModelSection
    target: TargetSection
    toolchain: ToolchainSection
    precision: PrecisionSection
    limits: LimitsSection
    kv_cache: KVCacheSection
    scheduler: SchedulerSection
    engine: EngineSection
    check: Optional[CheckSection]
    accuracy: Optional[AccuracyRecord]   # the accuracy gate's record (quantized plans)
    files: dict[str, FileEntry]      # every other file of the plan: size and sha256
    speculative: Optional[SpeculativeSection] = None   # absent: no speculative decoding
    lora: Optional[LoraSection] = None   # absent: the step takes no adapters
    build: Optional[BuildRecord] = None  # absent: a plan of a kiln that did not record it

    @classmethod
    def from_json(cls, data: Any) -> "PlanManifest":
        """A manifest from plan.json's parsed JSON; ManifestError names the first bad field.
        A manifest of another format version is refused by its version alone."""
        if not isinstance(data, dict):
            raise ManifestError("plan.json", f"expected an object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise ManifestError("format_version", f"{version!r}; this kiln reads version "
                                                  f"{PLAN_FORMAT_VERSION}")
        return cls._from_dict(data, "")

    @classmethod
    def loads(cls, text: str) -> "PlanManifest":
        return cls.from_json(json.loads(text))

    def to_json(self) -> dict:
        data = super().to_json()
        for key in ("speculative", "lora", "build"):   # absent ones are not written
            if data[key] is None:
                del data[key]
        return data

    def dumps(self) -> str:
        """plan.json's text."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    # -- facts read from the recorded spec (its schema is builder/spec.py's) --
    @property
    def pinned_isa(self) -> str:
        """The spec's target.isa: a level name, or "auto" (resolved at build)."""
        return (self.spec.get("target") or {}).get("isa", "auto")

    @property
    def golden(self) -> tuple["GoldenPrompt", ...]:
        """The spec's golden prompts."""
        return tuple(GoldenPrompt.from_json(g) for g in self.spec.get("golden") or ())

    @property
    def golden_agreement(self) -> Optional[float]:
        """The spec's minimum token agreement with the previous plan, if any."""
        return self.spec.get("golden_agreement")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True)
class StoredPlan:
    """The part of plan.json every format version has, read leniently: a plan store (kiln ci's,
    builder/plan_ci/store.py) keeps plans of older and newer kilns, so it reads only these; a plan
    of this kiln's version is read whole, as a PlanManifest, by runtime/plan.read_manifest."""
    name: Optional[str] = None
    fingerprint: Optional[str] = None
    created_at: str = ""
    file_sizes: dict[str, Optional[int]] = field(default_factory=dict)  # rel -> bytes
    fingerprint_inputs: dict = field(default_factory=dict)   # what the fingerprint hashed
    spec: dict = field(default_factory=dict)                 # the resolved spec

    @classmethod
    def from_json(cls, data: Any) -> Optional["StoredPlan"]:
        """None for something that is not a plan manifest at all."""
        if not isinstance(data, dict):
            return None

        def get(key, kind, default):
            v = data.get(key)
            return v if isinstance(v, kind) else default
        files = get("files", dict, {})
        return cls(name=get("name", str, None), fingerprint=get("fingerprint", str, None),
                   created_at=get("created_at", str, ""),
                   file_sizes={rel: (meta.get("size") if isinstance(meta, dict) else None)
                               for rel, meta in files.items()},
                   fingerprint_inputs=get("fingerprint_inputs", dict, {}),
                   spec=get("spec", dict, {}))


def manifest_digest(raw: bytes) -> str:
    """A plan's digest: the sha256 of its plan.json bytes. plan.json holds every other file's
    sha256, so the digest names the plan's whole content (kiln ci records it beside the
    fingerprint; `kiln serve --expect-digest` refuses any other plan)."""
    return hashlib.sha256(raw).hexdigest()
