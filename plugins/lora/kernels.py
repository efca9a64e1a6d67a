"""Compiled CPU kernel of `kiln::lora_apply`: build the library (cached) and load it.

The builder copies `build()`'s library into a plan built with a `lora` section; the runtime
`load()`s the plan's copy before the engine.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins import cpp_build
from kiln.plugins.isa import IsaLevel
from kiln.plugins.lora import ops  # noqa: F401  (defines the op's schema before its kernel)

NAME = "kiln_lora"
SOURCES = [Path(__file__).parent / "csrc" / "lora_cpu.cpp"]


def build(level: IsaLevel | None = None, verbose: bool = False) -> Path:
    """Compile the CPU kernel library for an ISA level (default: this machine's; cached by
    source, flags and torch); returns its path."""
    return cpp_build.build_library(NAME, SOURCES, level, verbose=verbose)


def load(path: Path | None = None) -> Path:
    """Load a kernel library (default: `build()`'s) into this process, once."""
    lib = build() if path is None else Path(path)
    cpp_build.load_library(lib)
    return lib
