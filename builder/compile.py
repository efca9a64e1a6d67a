"""Graph capture and compile backends: torch.export the packed-token step, AOTInductor it.

Dynamic dims (DESIGN.md): T up to max_num_tokens, B up to max_batch_size, max_blocks up to
ceil(max_seq_len / tokens_per_block), and the pool's num_blocks unbounded, so the runtime
sizes the KV pool from its memory budget at load without a rebuild.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.export import Dim

from kiln.builder.memory import release_freed
from kiln.contracts.manifest import (CheckSection, EngineSection, WeightsSection,
                                     WeightTensor)
from kiln.plugins.isa import IsaLevel
from kiln.plugins.paged_kv import kv_format
from kiln.runtime.executor import STEP_INPUTS, ModelInput
from kiln.runtime.lora_buffers import STEP_INPUT_NAMES as LORA_INPUT_NAMES
from kiln.runtime.lora_buffers import LoraBuffers

INPUT_NAMES = tuple(s.name for s in STEP_INPUTS) + ("k_caches", "v_caches")


def engine_plugins(spec, moe: bool = False) -> list[str]:
    """The plugins whose ops the engine calls (imported by the runtime before it loads);
    `moe`: the model has experts (kiln::moe_experts)."""
    return (["paged_kv"] + (["quant"] if spec.packed_weights else []) + (["moe"] if moe else [])
            + (["lora"] if spec.lora is not None else []))


def input_names(lora: bool) -> tuple[str, ...]:
    """The engine-step inputs in order; a plan with lora takes the adapters last."""
    return INPUT_NAMES + (LORA_INPUT_NAMES if lora else ())


def build_kernels(out_dir: Path, spec, level: IsaLevel | None, moe: bool = False) -> list[Path]:
    """Compile the plugins' C++ kernels for the target's ISA level and copy them into the plan
    (`moe`: the model has experts)."""
    libs = []
    if spec.target.is_gpu:
        return libs
    from kiln.plugins.engine_call import kernels as call_kernels
    from kiln.plugins.paged_kv import kernels as pa_kernels

    libs.append(pa_kernels.build(level))
    if spec.packed_weights:
        from kiln.plugins.quant import kernels as q_kernels

        libs.append(q_kernels.build(level))
    if moe:
        from kiln.plugins.moe import kernels as moe_kernels

        libs.append(moe_kernels.build(level))
    if spec.lora is not None:
        from kiln.plugins.lora import kernels as lora_kernels

        libs.append(lora_kernels.build(level))
    libs.append(call_kernels.build(level))   # the runtime calls the engine through it, GIL free
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for lib in libs:
        dst = out_dir / lib.name
        shutil.copyfile(lib, dst)
        copied.append(dst)
    from kiln.plugins.cpp_build import load_library

    for lib in copied:  # registers the kernels in this process (a no-op if already loaded)
        load_library(lib)
    return copied


def kernel_paths(plan_dir: Path, kernels: list[Path], level: IsaLevel | None
                 ) -> dict[str, str]:
    """{library: the code path it was compiled to}; refuses a scalar kernel at a vector level
    (a plan must never silently run the fallback on a machine that has vectors)."""
    from kiln.plugins.cpp_build import kernel_path

    paths = {k.relative_to(plan_dir).as_posix(): kernel_path(k) for k in kernels}
    scalar = [lib for lib, path in paths.items() if "scalar" in path or path == "unknown"]
    if level is not None and level.vector_bits and scalar:
        raise RuntimeError(f"kernel {', '.join(scalar)} compiled to its scalar path at CPU ISA "
                           f"{level.name} (flags {' '.join(level.flags)}): its vector path's "
                           "preprocessor conditions do not hold for these flags. This is a kiln "
                           "bug; the plan was not written.")
    return paths


def _dim(name: str, lo: int, hi: int):
    """A dynamic dim, or None (static) when the range is a single value."""
    return Dim(name, min=lo, max=hi) if hi > lo else None


def sample_input(T: int, B: int, tokens_per_block: int, num_logits: int) -> ModelInput:
    """A small packed batch of B sequences sharing T tokens (chunk + decodes), asking for the
    logits of its last num_logits tokens."""
    lens = [T - (B - 1)] + [1] * (B - 1)
    starts = [0] + [3] * (B - 1)
    tables = [[2 * i, 2 * i + 1] for i in range(B)]
    toks = [[(7 * i + j) % 50 for j in range(n)] for i, n in enumerate(lens)]
    return ModelInput.build(toks, starts, tables, tokens_per_block,
                            logits_indices=range(T - num_logits, T))


def weights_as_parameters(model: torch.nn.Module) -> None:
    """Make the model's persistent buffers (the packed weights, their scales) parameters that
    need no gradient, in place: the same tensors under the same names. AOTInductor keeps a
    clone of every buffer an exported program reads, as its value before the step could
    mutate it; the step mutates none (the KV pools are inputs), and those clones were a
    second copy of a quantized model's weights for the whole compile (1 GiB at 1B, 5 GiB at
    8B). A tensor registered under two names (a tied embedding and lm_head) stays one."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            param = made.get(id(buf))
            if param is None:
                param = made[id(buf)] = torch.nn.Parameter(buf, requires_grad=False)
            del module._buffers[name]
            module.register_parameter(name, param)


TRIM_EVERY = 256 << 20     # bind_mapped_weights hands freed heap pages back this often


def bind_mapped_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Point the model's parameters and buffers at the plan's mapped weights (tensors: {fqn:
    view of weights.bin}) after checking each holds the same values, so the check and the
    gate that follow hold the weights once (the page cache's pages) instead of the model's
    private copy beside the mapped plan. -> the bytes of private weights released.
    RuntimeError where the file and the model disagree (the plan is not written)."""
    sites: dict[int, tuple] = {}    # id(a tensor) -> (it, [(its table, name)] in the model)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, own in table.items():
                if own is not None:
                    sites.setdefault(id(own), (own, []))[1].append((table, attr))
    freed = 0
    for fqn, view in tensors.items():
        owner, _, attr = fqn.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue                # a constant of the compiled graph only (none on CPU now)
        own = module._parameters.get(attr)
        if own is None:
            own = module._buffers.get(attr)
        if own is None:
            continue
        if (own.dtype != view.dtype or own.shape != view.shape
                or not torch.equal(own, view)):
            raise RuntimeError(f"the plan's weights file disagrees with the model at {fqn}; "
                               "this is a kiln bug, the plan was not written")
        held, where = sites.pop(id(own), (None, ()))
        if held is not own or own.data_ptr() == view.data_ptr():
            continue
        new = (torch.nn.Parameter(view, requires_grad=False)
               if isinstance(own, torch.nn.Parameter) else view)
        for table, name in where:   # every name of it (a tied table: the file has one)
            table[name] = new
        size = own.untyped_storage().nbytes()
        del held, own               # freed here, one tensor at a time: no moment holds both
        freed += size
        if freed // TRIM_EVERY != (freed - size) // TRIM_EVERY:
            release_freed()         # small tensors' heap pages, returned as they go
    return freed


def capture(model: torch.nn.Module, max_num_tokens: int, max_batch_size: int, max_blocks: int,
            tokens_per_block: int, kv_dtype: str, lora=None):
    """torch.export the engine step with dynamic dims bounded by the limits; `lora` (the
    manifest's LoraSection): the step also takes the adapters. The model's weights become
    parameters (weights_as_parameters)."""
    cfg = model.cfg
    weights_as_parameters(model)
    B = min(2, max_batch_size)
    T = min(max(B, 8), max_num_tokens) if max_num_tokens >= 2 else 1
    num_blocks = max(4, 2 * B)
    # Logit rows have their own dim N (<= max_num_tokens): the engine asks for one row per
    # sequence, the accuracy gate for every position of a window in one step.
    inp = sample_input(T, B, tokens_per_block, num_logits=min(3, T))
    kc, vc = kv_format.new_pools(kv_dtype, cfg.num_layers, num_blocks, tokens_per_block,
                                 cfg.num_kv_heads, cfg.head_dim)
    b_dim = _dim("B", 1, max_batch_size)
    dims = {"T": _dim("T", 1, max_num_tokens), "B": b_dim,
            "B+1": b_dim + 1 if b_dim is not None else None,
            "max_blocks": _dim("max_blocks", 1, max_blocks), "N": _dim("N", 1, max_num_tokens)}
    nb_dim = Dim("num_blocks", min=2, max=1 << 24)
    dynamic_shapes = (
        *({i: dims[d] for i, d in enumerate(s.dims) if dims[d] is not None} or None
          for s in STEP_INPUTS),
        [{0: nb_dim}] * cfg.num_layers,
        [{0: nb_dim}] * cfg.num_layers,
    )
    args = (*inp.args(), kc, vc)
    if lora is not None:
        n = len(lora.target_modules)
        slots = torch.arange(T, dtype=torch.int64) % (lora.max_adapters_per_batch + 1) - 1
        args += LoraBuffers(lora, cfg.num_layers).args(slots)
        dynamic_shapes += ({0: dims["T"]} if dims["T"] is not None else None, None,
                           [None] * n, [None] * n)
    with torch.no_grad(), _export_traces_forgotten():
        return torch.export.export(model, args, dynamic_shapes=dynamic_shapes)


@contextlib.contextmanager
def _export_traces_forgotten():
    """Drop what torch's tracer keeps after an export or an AOTInductor compile: a module
    global maps each traced value to its graph node until the next trace, and those nodes'
    graph holds a module that references every weight the step read. Left alone, that kept
    the eager model's packed weights alive after the build pointed the model at the plan's
    mapped file (5 GiB at 8B)."""
    try:
        yield
    finally:
        from torch.fx.experimental import proxy_tensor

        traces = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
        if isinstance(traces, dict):
            traces.clear()


@dataclass(frozen=True)
class CompiledEngine:
    """What compile_engine wrote: the engine file, and where its weights went (None: inside it)."""
    file: Path
    weights: Optional[WeightsSection] = None


def compile_engine(ep, path: Path, backend: str, level: IsaLevel | None,
                   weights: Optional[Path] = None) -> CompiledEngine:
    """AOTInductor-compile the exported program into `path` (or save it uncompiled); a CPU
    plan's code is generated for its ISA level, a GPU plan's (level None) for the device.

    weights: a CPU plan's weights file (runtime/weights.py): the engine is compiled without
    its constants, which are written there instead, for the runtime to map (None: the
    constants stay inside the engine's .so, which each process loading it copies)."""
    if backend == "eager":
        torch.export.save(ep, str(path))
        return CompiledEngine(path)
    if backend != "aoti":
        raise ValueError(f"backend {backend!r} is not supported; allowed: aoti, eager")
    from kiln.builder.target import inductor_isa, kernel_regions
    from kiln.plugins import shims

    with contextlib.ExitStack() as cpu_codegen:
        cpu_codegen.enter_context(_export_traces_forgotten())
        if level is not None:      # a CPU plan: its ISA, regions for any thread count,
            cpu_codegen.enter_context(inductor_isa(level))     # kiln ops by their C shims
            cpu_codegen.enter_context(kernel_regions())
            cpu_codegen.enter_context(torch._inductor.config.patch(
                {"aot_inductor.custom_ops_to_c_shims": shims.declarations()}))
        if weights is not None:    # each constant pickled beside the code, with its strides
            cpu_codegen.enter_context(torch._inductor.config.patch(
                {"aot_inductor.package_constants_in_so": False,
                 "aot_inductor.package_constants_on_disk_format": "pickle_weights"}))
        # The generated model (its .cpp and a .so that embeds the weights: 100-540 MB for
        # SmolLM2) is written beside the package and removed once packaged, not into
        # Inductor's cache, which kept one per build forever (25 GB on this project's
        # CI host); a rebuild of unchanged inputs never compiles (the fingerprint).
        work = cpu_codegen.enter_context(
            tempfile.TemporaryDirectory(prefix=".aoti-", dir=path.parent))
        cpu_codegen.enter_context(torch._inductor.config.patch(
            {"aot_inductor.output_path": work}))
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    if weights is None:
        return CompiledEngine(path)
    return CompiledEngine(path, write_weights(path, weights))


def write_weights(package: Path, out: Path) -> WeightsSection:
    """Move the pickled constants out of the AOTInductor package `package` into the weights
    file `out` (runtime/weights.py's layout) -> its manifest section; the package keeps the
    code only. Constants that share storage (tied embedding and lm_head) share bytes."""
    import io
    import os
    import zipfile

    from kiln.runtime.weights import ALIGN

    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        configs = [n for n in names if n.endswith("/weights_config.json")]
        if len(configs) != 1:
            raise RuntimeError(f"the compiled engine has {len(configs)} weight configs, "
                               "expected one; this is a kiln bug, the plan was not written")
        config = json.loads(z.read(configs[0]))
        weights_dir = configs[0].split("/data/")[0] + "/data/weights/"
        where, tensors, pos = {}, {}, 0
        with open(out, "wb") as f:
            for fqn, (blob, shape, stride, offset) in sorted(config.items()):
                if blob not in where:   # one storage per blob, written once
                    t = torch.load(io.BytesIO(z.read(weights_dir + blob)), weights_only=True)
                    pos = -(-pos // ALIGN) * ALIGN
                    f.seek(pos)
                    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                    f.write(raw.numpy().data)
                    where[blob] = (pos, t.dtype)
                    pos += raw.numel()
                base, dtype = where[blob]
                tensors[fqn] = WeightTensor(offset=base + offset * dtype.itemsize,
                                            dtype=str(dtype).removeprefix("torch."),
                                            shape=tuple(shape), stride=tuple(stride))
            f.truncate(max(pos, 1))
        keep = [i for i in z.infolist() if not (i.filename.startswith(weights_dir)
                                                or i.filename == configs[0])]
        code = package.with_name(package.name + ".code")
        with zipfile.ZipFile(code, "w") as dst:
            for info in keep:
                dst.writestr(info, z.read(info))
    os.replace(code, package)
    return WeightsSection(file=out.name, tensors=tensors)


def _runs_rows16(model: torch.nn.Module) -> bool:
    """Whether a linear of the model runs kiln::linear_int4_rows16 (int4 weights in the
    interleaved layout, float activations; builder/quantize.py decides it per linear)."""
    from kiln.plugins.quant.modules import QuantLinear

    return any(isinstance(m, QuantLinear) and m.scheme == "int4_a8" and m.activations != "int8"
               for m in model.modules())


def kernels_compute_bf16(engine: EngineSection) -> bool:
    """Whether the plan's kernels compute a bf16 linear's batch rows (8 and more) in bf16, on
    AMX-BF16 tiles or AVX-512 BF16 dot products, rounding each input to bf16
    (plugins/quant/csrc/bf16_gemm.h, bf16_dot.h): the kernel path says "bf16 from 8 rows"."""
    return any("bf16 from 8 rows" in path for path in engine.kernel_paths.values())


def _rounds_bf16(model: torch.nn.Module, engine: EngineSection) -> bool:
    """Whether the model's bf16 linears round their inputs to bf16 (kernels_compute_bf16)."""
    from kiln.plugins.quant.modules import QuantLinear

    return (any(isinstance(m, QuantLinear) and m.scheme == "bf16" for m in model.modules())
            and kernels_compute_bf16(engine))


@torch.no_grad()
def check_engine(model: torch.nn.Module, plan_dir: Path, engine: EngineSection, spec,
                 kv_dtype: str, lora=None, weights=None) -> CheckSection:
    """Run the compiled step and the eager model on the same batches; they must agree.

    Two steps over the same pool (a prefill chunk, then decodes) so the in-place KV writes of
    the compiled step are exercised too; `lora` (LoraSection): random adapters in every slot,
    a different one per sequence and one sequence on the base model; `weights` (MappedWeights):
    the plan's weights, mapped once by the caller. Returns the max logit difference.
    """
    from kiln.runtime.plan import load_engine

    cfg = model.cfg
    bs = spec.kv_cache.tokens_per_block
    step = load_engine(plan_dir, engine, weights=weights)
    B = min(3, spec.limits.max_batch_size)
    chunk = min(spec.limits.max_num_tokens - (B - 1), 12, spec.limits.max_seq_len - 2)
    lens = [chunk] + [1] * (B - 1)
    num_blocks = 4 * B + 8
    pools = [kv_format.new_pools(kv_dtype, cfg.num_layers, num_blocks, bs, cfg.num_kv_heads,
                                 cfg.head_dim) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    tables = [[1 + 4 * i + j for j in range(4)][::-1] for i in range(B)]
    worst, scale = 0.0, 0.0
    starts = [0] * B
    adapters = None
    if lora is not None:
        adapters = LoraBuffers(lora, cfg.num_layers)
        adapters.fill_random(g)
        seq_slots = [i % adapters.num_slots for i in range(B - 1)] + [-1]
    for _ in range(2):
        toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        inp = ModelInput.build(toks, starts, tables, bs)
        extra = () if adapters is None else adapters.args(adapters.token_slots(seq_slots, lens))
        ref = model(*inp.args(), *pools[0], *extra)
        got = step(*inp.args(), *pools[1], *extra)
        worst = max(worst, (ref - got).abs().max().item())
        scale = max(scale, ref.abs().max().item())
        starts = [s + n for s, n in zip(starts, lens)]
        lens = [1] * B
    tol = _check_tolerance(model, engine, spec, kv_dtype, scale)
    if not worst <= tol:
        raise RuntimeError(f"the compiled engine disagrees with the eager model: max logit "
                           f"difference {worst:.3g} > {tol}; this is a compiler bug, the plan "
                           "was not written (try target.backend: eager to debug)")
    return CheckSection(max_logit_diff=worst, tolerance=tol)


def _check_tolerance(model, engine: EngineSection, spec, kv_dtype: str, scale: float) -> float:
    """The largest logit difference check_engine allows between the compiled step and the eager
    model, whose logits reach `scale`."""
    # Both sides run the same ops (quantized plans: the same kiln::linear_* kernels, loaded
    # by build_kernels), so the difference is the compiler's alone: fusion and summation
    # order, amplified by bf16 roundings of weights or K/V where those are bf16. An int8/fp8
    # KV cache amplifies it most: a K/V value that moves by an ulp can land on the other
    # side of a rounding boundary, one code step (1/127 of the row's max, or 1/16 of the
    # value for E4M3) — SmolLM2 int8: 0.06. A broken scale or layout is off by whole units.
    # W8A8 quantizes every linear's input at run time: there a compiler's ulp flips
    # activation codes (1/127 of a row's max) in every layer, and the flips compound over the
    # layers (SmolLM2 with SmoothQuant: 2.0 logits of a scale of 32; a random-weight
    # Llama-3.1-8B-shaped W4A8 model, 32 layers: 0.63 of 6.0). Its bound is relative: a
    # fifth of the logits' scale; a broken kernel is off by the whole scale.
    # int4 weight-only in the interleaved layout (kiln::linear_int4_rows16: CPU, group 32)
    # holds each group of 32 of x as two int8 digits, so there an ulp can move an activation
    # by the last digit's unit, 1/16,256 of its group's max: SmolLM2 with a bf16 KV cache
    # 0.048 (VNNI) and 0.084 (AVX2), over the 0.05 that bounds the plans whose activations
    # stay float.
    # bf16 weights on AMX-BF16 tiles or AVX-512 BF16 round each linear's input to bf16 at run
    # time: an ulp there flips a rounding, 1/256 of the activation, in every layer (SmolLM2: 0.13).
    # The accuracy gate then measures the compiled plan against the float model.
    if spec.precision.activations == "int8":
        return 0.2 * max(scale, 1.0)
    if _runs_rows16(model) or _rounds_bf16(model, engine):
        return 0.25
    if kv_dtype in kv_format.QUANTIZED:
        return 0.25 if kv_dtype == "int8" else 0.5
    if kv_dtype == "fp32" and spec.precision.weights == "fp32":
        return 1e-3
    if kv_dtype == "fp32" and spec.packed_weights:
        return 5e-3
    return 5e-2
