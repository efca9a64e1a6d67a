"""Compiled kernels of `kiln::paged_attention`: build the CPU library (cached) and load it.

    path = kernels.build()   # lib kiln_paged_attention.so, compiled once per source/flags/torch
    kernels.load(path)       # registers the CPU kernel; torch.ops.kiln.paged_attention uses it

The builder copies `build()`'s library into the plan; the runtime `load()`s the plan's copy
before the engine.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins import cpp_build
from kiln.plugins.isa import IsaLevel
from kiln.plugins.paged_kv import ops  # noqa: F401  (defines the op's schema before its kernels)

NAME = "kiln_paged_attention"
SOURCES = [Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"]


def build(level: IsaLevel | None = None, verbose: bool = False) -> Path:
    """Compile the CPU kernel library for an ISA level (default: this machine's; cached by
    source, flags and torch); returns its path."""
    return cpp_build.build_library(NAME, SOURCES, level, verbose=verbose)


def load(path: Path | None = None) -> None:
    """Load a kernel library (default: `build()`'s) into this process, once."""
    cpp_build.load_library(path if path is not None else build())
