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

from kiln.contracts.manifest import TargetSection
from kiln.plugins import isa as cpu_isa


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


def cpu_target(level: cpu_isa.IsaLevel) -> TargetSection:
    """The manifest's `target` for a CPU plan compiled at `level`."""
    return TargetSection(device="cpu", arch=platform.machine(), isa=level.name,
                         isa_flags=tuple(cpu_isa.compile_flags(level)),
                         cpu_features=tuple(cpu_isa.compiler_features(level.flags)),
                         compute_capability=None)


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


# Fewer elements than this in a fused kernel and its OpenMP region is not worth opening.
SERIAL_BELOW_ELEMENTS = 8192
# The thread count Inductor's loop-splitting heuristic plans for (how many loops of a kernel
# it collapses into the parallel one); fixed, so the build machine's cores never enter a plan.
CODEGEN_THREADS = 2


@contextlib.contextmanager
def kernel_regions(min_elements: int = SERIAL_BELOW_ELEMENTS):
    """Make AOTInductor's CPU kernels independent of the build machine's thread count, and
    open their OpenMP region only when the call is large.

    Left alone, Inductor writes the compiling process's `torch.get_num_threads()` into the
    code: at one thread (a `kiln ci` worker, a test session) no kernel is parallel at all; at
    the machine's CPU count a region has no num_threads clause but a parallel reduction sums
    into `acc_arr[<that count>]`, indexed by the thread number of a team sized at run time
    (a plan built on 2 cores and served with 16 threads writes past the array); at any other
    count the region is `num_threads(N)`, fixed. The same spec gave different plans on
    different builders, under one fingerprint. Inside, Inductor plans for `CODEGEN_THREADS`
    and writes every region for a thread count known at run time (`cpp.dynamic_threads`:
    no num_threads clause, reduction arrays of `omp_get_max_threads()`), so the code is the
    same on every builder and correct for any team, one thread included.

    Inductor decides at compile time whether a fused kernel runs in parallel; the token
    count of the engine step is dynamic, so the norms, RoPE and residual adds of a SmolLM2
    step would each open a region even at decode, where one token's 576-3072 elements are a
    single iteration of the parallel loop: one thread works, the other waits, and the fork
    and join cost more than the work (about 230 regions a step, 460 of its 770 futex calls).
    An OpenMP `if` clause does not help: libgomp still forms a one-thread team and wakes its
    barrier (measured: 120 of the 460 futex calls saved, the step 2% faster). So each region
    is written twice: `if (elements >= min_elements)` Inductor's region, `else` the same block
    with its `#pragma omp` lines dropped (OpenMP's serial elision: a region's code with its
    directives ignored is what a team of one runs), plain loops the compiler optimizes like
    any serial code. (A lambda called through `#pragma omp parallel` or directly, named
    per region, made every kernel's source unique, so Inductor stopped sharing a layer's
    kernels with the other layers': 121 kernel functions in the SmolLM2 plan, 10 now.) A
    kernel of static size gets the same test on a constant, which the compiler folds.
    """
    from torch._inductor import config as iconfig
    from torch._inductor.codegen import cpp as icpp
    from torch._inductor.codegen.cpp_utils import cexpr_index
    from torch._inductor.utils import sympy_product

    proxy, sharing = icpp.CppKernelProxy, icpp.WorkSharing
    saved_loops, saved_parallel = proxy.codegen_loops_impl, sharing.parallel

    def codegen_loops_impl(self, loop_nest, code, worksharing):
        worksharing.kiln_elements = self.rename_indexing(sympy_product(self.call_ranges))
        return saved_loops(self, loop_nest, code, worksharing)

    def parallel(self, threads):     # WorkSharing.parallel, with the serial path
        elements = getattr(self, "kiln_elements", None)
        if elements is None or (self.in_parallel and threads == self.num_threads):
            return saved_parallel(self, threads)
        if self.in_parallel:
            self.close()
        self.num_threads, self.in_parallel = threads, True
        code, marks = self.code, {}
        lines = code.get_lines_ref()

        def serial_copy():                     # after both closing braces
            body = [line.replace("omp_get_thread_num()", "0") if isinstance(line, str) else line
                    for line in lines[marks["start"]:marks["end"]]
                    if not (isinstance(line, str) and line.lstrip().startswith("#pragma omp"))]
            code.writeline("else")
            with code.indent():
                lines.extend(body)             # as written, indentation included

        self.stack.callback(serial_copy)
        code.writeline(f"if ({cexpr_index(elements)} >= {min_elements})")
        self.stack.enter_context(code.indent())
        code.writeline("#pragma omp parallel")
        marks["start"] = len(lines)
        self.stack.callback(lambda: marks.__setitem__("end", len(lines)))
        self.stack.enter_context(code.indent())
        code.writeline("int tid = omp_get_thread_num();")

    proxy.codegen_loops_impl, sharing.parallel = codegen_loops_impl, parallel
    try:
        with iconfig.patch({"cpp.threads": CODEGEN_THREADS, "cpp.dynamic_threads": True}):
            yield
    finally:
        proxy.codegen_loops_impl, sharing.parallel = saved_loops, saved_parallel
