"""The AOTInductor C shims of kiln's CPU custom ops (C++: plugins/csrc/aoti_shim.h).

A CPU plan's compiled graph calls `aoti_torch_cpu_<op>(...)` for each kiln op instead of
AOTInductor's proxy executor, which boxed every call into an IValue stack from a JSON
description of its arguments (~1 us a call warm, more with the step's weights streaming
through the caches; a SmolLM2 decode step makes ~150 such calls). `declarations()` gives
Inductor the C declaration of each shim, derived from the op's schema by the rules of its C
shim codegen: Tensor -> AtenTensorHandle, Tensor? -> AtenTensorHandle* (nullptr for None),
int -> int64_t, float -> double, one Tensor result -> AtenTensorHandle* ret0.
"""
from __future__ import annotations

import torch

# the ops with C++ CPU kernels (and shims) in the plugins' kernel libraries
CPU_OPS = ("linear_int8", "linear_int4", "linear_fp8", "linear_bf16", "linear_fp32",
           "linear_int8_a8", "linear_int4_a8", "linear_int4_rows16", "paged_attention",
           "moe_experts", "moe_experts_quant", "moe_experts_a8", "lora_apply")

_ARG_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*",
              "int": "int64_t", "float": "double"}


def declaration(op: torch._ops.OpOverload) -> str:
    """The C declaration of `op`'s CPU shim; ValueError for a schema it cannot express."""
    schema = op._schema
    args = []
    for a in schema.arguments:
        t = str(a.type)
        if t not in _ARG_TYPES:
            raise ValueError(f"{schema.name}: argument {a.name} of type {t} has no C shim type")
        args.append(_ARG_TYPES[t])
    if [str(r.type) for r in schema.returns] != ["Tensor"]:
        raise ValueError(f"{schema.name}: only ops returning one Tensor have C shims")
    name = schema.name.split("::")[-1]
    return f"AOTITorchError aoti_torch_cpu_{name}({', '.join(args + ['AtenTensorHandle*'])})"


def _import_schemas() -> None:
    from kiln.plugins.lora import ops as _l  # noqa: F401  (the schemas)
    from kiln.plugins.moe import ops as _m  # noqa: F401
    from kiln.plugins.paged_kv import ops as _pa  # noqa: F401
    from kiln.plugins.quant import ops as _q  # noqa: F401


def ops_abi() -> str:
    """A digest of the schemas of the ops whose C++ kernels a CPU plan carries: a plan's
    kernel libraries register against these schemas, so a runtime whose schemas differ
    (an argument added) cannot load them (torch aborts the process). Recorded in the
    manifest's toolchain and checked before anything is loaded."""
    import hashlib

    _import_schemas()
    text = "\n".join(str(getattr(torch.ops.kiln, n).default._schema) for n in CPU_OPS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def declarations() -> dict[torch._ops.OpOverload, list[str]]:
    """aot_inductor.custom_ops_to_c_shims for a CPU plan: every kiln op with a CPU kernel."""
    _import_schemas()
    out = {}
    for name in CPU_OPS:
        op = getattr(torch.ops.kiln, name).default
        out[op] = [declaration(op)]
    return out
