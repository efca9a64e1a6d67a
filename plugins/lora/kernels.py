"""Compiled CPU kernel of `kiln::lora_apply`: `build(level)` (cached) and `load(path)`.

The builder copies `build()`'s library into a plan built with a `lora` section; the runtime
loads the plan's copy before the engine.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins import cpp_build
from kiln.plugins.lora import ops  # noqa: F401  (defines the op's schema before its kernel)

NAME = "kiln_lora"
LIBRARY = cpp_build.KernelLibrary(NAME, [Path(__file__).parent / "csrc" / "lora_cpu.cpp"])
build, load = LIBRARY.build, LIBRARY.load
