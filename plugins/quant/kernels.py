"""Build and load the compiled CPU kernels of the quant ops (csrc/quant_linear.cpp).

The builder calls `build()` and copies the returned .so into the plan; the runtime calls
`load(path)` on the plan's copy. Tests and benchmarks call `load()` with no path, which builds
(cached by plugins.cpp_build) and loads in one go.
"""
from __future__ import annotations

from pathlib import Path

from kiln.plugins import cpp_build
from kiln.plugins.isa import IsaLevel
from kiln.plugins.quant import ops  # noqa: F401  (the schemas must exist before the kernels)

NAME = "kiln_quant"
SOURCES = [Path(__file__).parent / "csrc" / "quant_linear.cpp",
           Path(__file__).parent / "csrc" / "linear_a8.cpp",
           Path(__file__).parent / "csrc" / "linear_int4_a8.cpp"]


def build(level: IsaLevel | None = None, verbose: bool = False) -> Path:
    """Compile (or find in the cache) the kernel library for an ISA level (default: this
    machine's); returns the .so path."""
    return cpp_build.build_library(NAME, SOURCES, level, verbose=verbose)


def load(path: Path | None = None) -> Path:
    """Load the kernel library (built here if `path` is None); returns the path loaded."""
    lib = build() if path is None else Path(path)
    cpp_build.load_library(lib)
    return lib
