"""The library through which a CPU plan's compiled engine is called without the GIL
(csrc/engine_call.cpp): built by the builder into the plan's kernels, loaded by the runtime
with them. torch's package loader holds the GIL for the whole step; through
`torch.ops.kiln_engine.run` the serving threads run their Python while the step computes.

    path = kernels.build()   # lib kiln_engine_call.so (cached by source, flags and torch)
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins import cpp_build
from kiln.plugins.isa import IsaLevel

NAME = "kiln_engine_call"
SOURCES = [Path(__file__).parent / "csrc" / "engine_call.cpp"]


def build(level: IsaLevel | None = None, verbose: bool = False) -> Path:
    """Compile the library (cached); returns its path."""
    return cpp_build.build_library(NAME, SOURCES, level, verbose=verbose)


def available() -> bool:
    """Whether a loaded library registered the kiln_engine ops in this process."""
    import torch

    try:
        torch.ops.kiln_engine.run
    except (AttributeError, RuntimeError):
        return False
    return True
