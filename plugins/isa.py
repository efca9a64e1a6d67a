"""CPU vector ISA levels a plan is compiled for, and the CPU features the compiled code needs.

A level names one set of compiler flags; the same flags compile the AOTInductor engine and
every plugin library, so a plan's code needs one set of instructions. What those flags make
the code need is asked of the compiler itself (the feature macros it predefines with the
flags and not without them), so no table of "ISA name -> CPU flags" has to follow torch or
the compiler:

    level avx512_vnni --flags--> -mavx512f ... -mavx512vnni --c++ -dM -E--> __AVX512VNNI__, ...
                                                            --> cpu_features: avx512_vnni, ...

The plan records those features (`target.cpu_features`); a machine runs the plan when its
/proc/cpuinfo flags include every one of them. This module is torch-free: the runtime's
check needs neither torch nor a compiler.
"""
from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class IsaLevel:
    """One CPU code-generation level: the flags and ATen macros its code is compiled with."""

    name: str                 # spec spelling: target.isa
    flags: tuple[str, ...]    # compiler flags (engine and plugins alike)
    macros: tuple[str, ...]   # ATen's Vectorized<> specialization (CPU_CAPABILITY_*)
    torch_isa: str | None     # torch._inductor.cpu_vec_isa class AOTInductor generates for
    vector_bits: int          # width of at::vec::Vectorized; 0: scalar code


_AVX512 = ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c")
# Ordered from lowest to highest; every x86-64 CPU with AVX-512 also has AVX2, FMA and F16C
# (-mf16c is added to torch's AVX-512 flags, which lack it: without it the plugins' AVX2
# paths, which convert halfs, compiled to their scalar fallbacks).
LEVELS: dict[str, IsaLevel] = {lv.name: lv for lv in (
    IsaLevel("none", (), (), None, 0),
    IsaLevel("avx2", ("-mavx2", "-mfma", "-mf16c"), ("CPU_CAPABILITY_AVX2",), "VecAVX2", 256),
    IsaLevel("avx512", _AVX512, ("CPU_CAPABILITY_AVX512",), "VecAVX512", 512),
    IsaLevel("avx512_vnni", _AVX512 + ("-mavx512vnni",), ("CPU_CAPABILITY_AVX512",),
             "VecAVX512VNNI", 512),
    IsaLevel("avx512_bf16", _AVX512 + ("-mavx512vnni", "-mavx512bf16"),
             ("CPU_CAPABILITY_AVX512",), "VecAVX512VNNI", 512),
    IsaLevel("amx", _AVX512 + ("-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                               "-mamx-int8"), ("CPU_CAPABILITY_AVX512",), "VecAMX", 512),
)}
LEVEL_NAMES = tuple(LEVELS)

# Where the compiler's feature macro and Linux's /proc/cpuinfo flag spell one feature
# differently (compared after dropping underscores and case: AVX512VNNI == avx512_vnni).
_CPUINFO_ALIASES = {
    "sse3": "pni",
    "crc32": "sse4_2",        # CRC32 is part of SSE4.2; cpuinfo has no flag of its own
    "lzcnt": "abm",
    "pclmul": "pclmulqdq",
    "sha": "sha_ni",
    "avxvnni": "avx_vnni",
    "evex512": "avx512f",     # GCC 14+: 512-bit EVEX encodings, present on every AVX-512 CPU
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512vp2intersect": "avx512_vp2intersect",
}


def _key(feature: str) -> str:
    return feature.lower().replace("_", "")


def cpuinfo_name(feature: str) -> str:
    """The /proc/cpuinfo spelling of a compiler feature name (sse3 -> pni)."""
    return _CPUINFO_ALIASES.get(_key(feature), feature.lower())


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo), or of a cpuinfo text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_features(needed, have) -> list[str]:
    """The features of `needed` that the flag set `have` lacks (spelling-insensitive)."""
    keys = {_key(f) for f in have}
    return [f for f in needed if _key(cpuinfo_name(f)) not in keys]


def flag_features(flags) -> list[str]:
    """The features a flag list names directly (-mavx512vnni -> avx512vnni).

    A subset of what the flags make the compiler assume (`compiler_features` has all); enough
    to tell which level a machine can run without a compiler at hand.
    """
    return [f[2:].replace("-", "_") for f in flags if f.startswith("-m")]


def _highest(have, features_of) -> IsaLevel:
    """The highest level all of whose `features_of(flags)` the flag set `have` includes
    (levels the compiler cannot compile for are not candidates)."""
    best = LEVELS["none"]
    if not is_x86():
        return best
    for lv in LEVELS.values():
        try:
            if not missing_features(features_of(lv.flags), have):
                best = lv
        except CompilerError:
            continue
    return best


def best_level(have) -> IsaLevel:
    """The highest level whose named features the flag set `have` includes (no compiler)."""
    return _highest(have, flag_features)


class CompilerError(RuntimeError):
    """The C++ compiler cannot compile for a level's flags."""


def _compiler() -> str:
    for cxx in ("c++", "g++", "clang++"):
        if shutil.which(cxx):
            return cxx
    raise CompilerError("no C++ compiler (c++, g++ or clang++) on PATH; CPU plans compile C++")


@functools.lru_cache(maxsize=None)
def _predefined(flags: tuple[str, ...]) -> frozenset[str]:
    cmd = [_compiler(), *flags, "-dM", "-E", "-x", "c++", "-"]
    r = subprocess.run(cmd, input="", capture_output=True, text=True)
    if r.returncode != 0:
        raise CompilerError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()[:500]}")
    return frozenset(m for m in re.findall(r"^#define (__[A-Z0-9_]+__) 1$", r.stdout, re.M))


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def base_march() -> tuple[str, ...]:
    """The architecture baseline every level starts from. On x86-64 it is explicit: a compiler
    left to its default may target more (torch's Inductor compiles with -march=native, which
    put AVX-512 instructions into an "avx2" engine on an AVX-512 build host)."""
    return ("-march=x86-64",) if is_x86() else ()


def compile_flags(lv: IsaLevel) -> tuple[str, ...]:
    """All the flags that decide which instructions a level's code uses."""
    return base_march() + lv.flags


def compiler_features(flags) -> list[str]:
    """The CPU features code compiled with `flags` may use, as /proc/cpuinfo names them.

    Asked of the compiler: the feature macros it predefines with the flags (after the
    architecture baseline) and not for the baseline alone (-mavx512f also turns on __AVX2__,
    __FMA__ is only there with -mfma, ...). Every x86-64 CPU has the baseline's SSE2.
    """
    flags = base_march() + tuple(f for f in flags if not f.startswith("-march="))
    added = _predefined(flags) - _predefined(base_march())
    return sorted({cpuinfo_name(m.strip("_")) for m in added})


def host_level(have: set[str] | None = None) -> IsaLevel:
    """The highest level whose code this machine (or the flag set `have`) runs: every
    compiler-derived feature present. Needs a C++ compiler; the runtime uses `best_level`."""
    return _highest(cpu_flags() if have is None else have, compiler_features)


def level(name: str) -> IsaLevel:
    try:
        return LEVELS[name]
    except KeyError:
        raise ValueError(f"unknown CPU ISA level {name!r}; allowed: {AUTO}, "
                         f"{', '.join(LEVEL_NAMES)}") from None
