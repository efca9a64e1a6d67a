"""The concrete CPU target of a build: the spec's `target.isa` resolved on this build machine.

    target.isa (auto | none | avx2 | avx512 | avx512_vnni | avx512_bf16 | amx)
        -> IsaLevel (plugins/isa.py: compiler flags)
        -> cpu_features (what those flags let the compiler use, asked of the compiler)
        -> refused here when this machine lacks one (the build runs the plan it compiles)

`inductor_isa(level)` pins AOTInductor's code generation to the level's flags for the
duration of a compile, so the engine and the plugin libraries need the same instructions,
and a plan for a lower level than this machine's can be built here.
"""
from __future__ import annotations

import contextlib
import os
import platform

from plugins import isa as cpu_isa


class TargetError(RuntimeError):
    """A target this build machine cannot compile or run; the message names what is missing."""


def resolve_level(name: str, spec_name: str = "", have: set[str] | None = None
                  ) -> cpu_isa.IsaLevel:
    """`target.isa` -> the level to build; TargetError when this machine cannot run it."""
    have = cpu_isa.cpu_flags() if have is None else have
    if name == cpu_isa.AUTO:
        return cpu_isa.host_level(have)
    level = cpu_isa.level(name)
    if level.flags and not cpu_isa.is_x86():
        raise TargetError(f"target.isa {name!r} is an x86-64 level; this build machine is "
                          f"{platform.machine()}. Use target.isa: auto or none.")
    try:
        features = cpu_isa.compiler_features(level.flags)
    except cpu_isa.CompilerError as e:
        raise TargetError(f"target.isa {name!r}: the C++ compiler here cannot compile for it "
                          f"({e})") from None
    missing = cpu_isa.missing_features(features, have)
    if missing:
        best = cpu_isa.host_level(have)
        raise TargetError(
            f"target.isa {name!r} needs CPU features {', '.join(missing)}, which this build "
            f"machine lacks (the build runs the plan it compiles, for the compiled-vs-eager "
            f"check and the accuracy gate). Build on a machine that has them, or set "
            f"target.isa: {best.name} (the highest level this machine runs) or auto"
            + (f" in {spec_name}" if spec_name else "") + ".")
    return level


def cpu_target(level: cpu_isa.IsaLevel) -> dict:
    """The manifest's `target` for a CPU plan compiled at `level`."""
    return {"device": "cpu", "arch": platform.machine(), "isa": level.name,
            "isa_flags": list(cpu_isa.compile_flags(level)),
            "cpu_features": cpu_isa.compiler_features(level.flags),
            "compute_capability": None}


def _torch_vec_isa(level: cpu_isa.IsaLevel):
    """A torch VecISA that generates code for `level` with exactly the level's flags."""
    from torch._inductor import cpu_vec_isa as cvi

    if level.torch_isa is None:
        return None
    base = getattr(cvi, level.torch_isa)
    flags = " ".join(level.flags)
    pinned = type(f"Kiln{base.__name__}", (base,), {
        "_arch_flags": flags,
        "_macro": list(level.macros),
        "build_arch_flags": lambda self: flags,
        "build_macro": lambda self: list(level.macros),
        "__bool__": lambda self: True,   # resolve_level checked this machine runs it
        "__hash__": cvi.VecISA.__hash__,
    })
    return pinned()


@contextlib.contextmanager
def inductor_isa(level: cpu_isa.IsaLevel):
    """Make AOTInductor generate and compile code for `level` (and nothing else) inside.

    Inductor asks `cpu_vec_isa.pick_vec_isa()` everywhere it needs the ISA; that function
    chooses among `valid_vec_isa_list()`, which is replaced here by the one pinned ISA (or
    none: scalar code). Inductor's default -march=native is replaced by the x86-64 baseline,
    so the level's flags alone add instructions. The FX graph cache is off inside, so no
    graph compiled for another level is reused.
    """
    import torch._inductor.config as iconfig
    from torch._inductor import cpu_vec_isa as cvi

    pinned = _torch_vec_isa(level)
    saved_list, saved_env = cvi.valid_vec_isa_list, os.environ.pop("ATEN_CPU_CAPABILITY", None)
    cvi.valid_vec_isa_list = lambda: [pinned] if pinned is not None else []
    try:
        march = [f[len("-march="):] for f in cpu_isa.base_march()]
        with iconfig.patch({"cpp.simdlen": None, "fx_graph_cache": False,
                            "cpp.march": march[0] if march else ""}):
            yield
    finally:
        cvi.valid_vec_isa_list = saved_list
        if saved_env is not None:
            os.environ["ATEN_CPU_CAPABILITY"] = saved_env
