"""Compiled kernels of `kiln::paged_attention`: build the CPU library (cached) and load it.

    path = kernels.build()   # lib kiln_paged_attention.so, compiled once per source/flags/torch
    kernels.load(path)       # registers the CPU kernel; torch.ops.kiln.paged_attention uses it

The builder copies `build()`'s library into the plan; the runtime `load()`s the plan's copy
before the engine.
"""
from __future__ import annotations

from pathlib import Path

from plugins import cpp_build
from plugins.paged_kv import ops  # noqa: F401  (defines the op's schema before its kernels)

NAME = "kiln_paged_attention"
SOURCES = [Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"]


def _isa_macros() -> list[str]:
    """-D flags that select ATen's Vectorized<> specialization for AOTInductor's vector ISA."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return [f"-D{m}" for m in getattr(isa, "_macro", [])] if isa else []


def build(verbose: bool = False) -> Path:
    """Compile the CPU kernel library (cached by source, flags and torch); returns its path."""
    return cpp_build.build_library(NAME, SOURCES, extra_cflags=_isa_macros(), verbose=verbose)


def load(path: Path | None = None) -> None:
    """Load a kernel library (default: `build()`'s) into this process, once."""
    cpp_build.load_library(path if path is not None else build())
