"""Build and load the compiled CPU kernels of the quant ops (csrc/, one file per family of
ops: the table at the top of plugins/quant/ops.py).

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
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "linear_weight_only.cpp",   # kiln::linear_int8 / int4 / fp8
           CSRC / "linear_float.cpp",         # kiln::linear_fp32 / bf16
           CSRC / "linear_int8_a8.cpp",       # kiln::linear_int8_a8 (W8A8)
           CSRC / "linear_int4_a8.cpp",       # kiln::linear_int4_a8 (W4A8)
           CSRC / "linear_int4_rows16.cpp"]   # kiln::linear_int4_rows16 (int4_a8 weight-only)


def build(level: IsaLevel | None = None, verbose: bool = False) -> Path:
    """Compile (or find in the cache) the kernel library for an ISA level (default: this
    machine's); returns the .so path."""
    return cpp_build.build_library(NAME, SOURCES, level, verbose=verbose)


def load(path: Path | None = None) -> Path:
    """Load the kernel library (built here if `path` is None); returns the path loaded."""
    lib = build() if path is None else Path(path)
    cpp_build.load_library(lib)
    return lib
