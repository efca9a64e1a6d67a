"""Compile a plugin's C++ `torch.library` kernels into a shared library, and load one.

The builder calls `build_library` and copies the .so into the plan; the runtime calls
`load_library` on the plan's copy before loading the engine. Builds are cached by a hash of
the sources (and the headers beside them), flags and torch version, so tests and unchanged
rebuilds compile nothing.

The library is compiled for one CPU ISA level (plugins/isa.py), the level the builder also
pins AOTInductor to, so a plan's kernels and its compiled graph need the same instructions.
Each kernel source embeds the name of the code path its vector macros selected
(`KILN_KERNEL_PATH:...`); `kernel_path()` reads it back from the library's bytes, so the
builder and `kiln inspect` can say which path a plan runs without loading it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from kiln.plugins import isa as cpu_isa

CACHE_ROOT = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))


def build_library(name: str, sources: list[Path], level: cpu_isa.IsaLevel | None = None,
                  verbose: bool = False) -> Path:
    """Compile `sources` for an ISA level (default: this machine's) into <name>.so (cached)."""
    from torch.utils import cpp_extension

    level = level or cpu_isa.host_level()
    cflags = ["-O3", "-std=c++17", "-fopenmp", *cpu_isa.compile_flags(level),
              *(f"-D{m}" for m in level.macros)]
    h = hashlib.sha256()
    for src in sources:
        h.update(Path(src).read_bytes())
    headers = {f for src in sources for f in Path(src).parent.glob("*.h")}
    headers |= set((Path(__file__).parent / "csrc").glob("*.h"))     # shared: aoti_shim.h
    for header in sorted(headers):
        h.update(header.name.encode() + b"\0" + header.read_bytes())   # what the sources include
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    key = h.hexdigest()[:16]
    build_dir = CACHE_ROOT / "kernels" / f"{name}-{key}"
    lib = build_dir / f"{name}.so"
    if lib.exists():
        return lib
    tmp = build_dir.with_name(build_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                       is_python_module=False, is_standalone=False, verbose=verbose)
    # load() also dlopens the library into this process, which is what a caller wants.
    if not (tmp / f"{name}.so").exists():
        raise RuntimeError(f"building {name} produced no {name}.so in {tmp}")
    _global(tmp / f"{name}.so")
    _loaded.add(_digest(tmp / f"{name}.so"))
    try:
        os.replace(tmp, build_dir)
    except OSError:  # another process won the race; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


_PATH_MARK = re.compile(rb"KILN_KERNEL_PATH:([^\x00]{1,200})\x00")


def kernel_path(lib: Path) -> str:
    """The code paths a kernel library was compiled to (embedded by each source, joined by
    "; "), e.g. "avx2: ... decoders; w8a8: avx512-vnni vpdpbusd"; "unknown" if it says none."""
    paths = [m.decode() for m in _PATH_MARK.findall(Path(lib).read_bytes())]
    return "; ".join(paths) if paths else "unknown"


# Content digests of the libraries loaded in this process: a copy of a library (the plan's
# copy of a kernel the builder just compiled) must not register its kernels a second time.
_loaded: set[str] = set()


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_library(path: Path) -> None:
    """dlopen a kernel library once per process (its TORCH_LIBRARY_IMPL registrations), its
    symbols global: a CPU plan's compiled graph calls the libraries' C shims
    (plugins/shims.py) by name."""
    digest = _digest(path)
    if digest in _loaded:
        return
    _global(path)
    torch.ops.load_library(os.path.realpath(path))
    _loaded.add(digest)


def _global(path: Path) -> None:
    """dlopen with RTLD_GLOBAL (a library already loaded locally is promoted)."""
    ctypes.CDLL(os.path.realpath(path), mode=os.RTLD_GLOBAL | os.RTLD_NOW)


class KernelLibrary:
    """A plugin's C++ kernel library: `build(level)` compiles it (cached), `load(path)` loads
    a copy of it (default: this machine's build) into the process."""

    def __init__(self, name: str, sources: list[Path]):
        self.name, self.sources = name, list(sources)

    def build(self, level: cpu_isa.IsaLevel | None = None, verbose: bool = False) -> Path:
        """Compile for an ISA level (default: this machine's); returns the library's path."""
        return build_library(self.name, self.sources, level, verbose=verbose)

    def load(self, path: Path | None = None) -> Path:
        """Load a kernel library (default: `build()`'s) into this process, once."""
        lib = self.build() if path is None else Path(path)
        load_library(lib)
        return lib
