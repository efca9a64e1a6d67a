"""Which thread computes: the engine's, and no other.

The compiled step and the plugin kernels run OpenMP parallel regions. libgomp gives every
thread that starts a region its own pool of worker threads, and once a process has more pool
threads than CPUs it stops spinning between regions and sleeps instead; a step has hundreds of
short regions, so each pays a futex wake-up. Measured on 2 cores (SmolLM2 W8A8 plan, one
sequence decoding): the step alone runs 165 steps/s, but 41 steps/s from a second thread once
the process's main thread (or a loader thread) had run a 2-thread region too -- the whole
gap between `Engine.step()` in a loop and tokens through `submit()` that the engine showed.

So a serving process is laid out as: every thread but the engine's computes single-threaded
(`claim_process`, before torch is imported, sets OMP_NUM_THREADS=1 for the process), and the
engine thread raises its own OpenMP thread count to the cores it was given
(`enter_engine_thread`). Python work on other threads (gRPC, detokenizing for the API,
tokenizing) then never owns a pool that competes with the step's.

Where the engine is given fewer threads than the process has cores, the cores are split too:
the engine thread and its OpenMP workers run on the first `threads` cores, every other thread
(the event loop, the post and gRPC threads, tokenizing) on the rest, so the serving work never
preempts a compute thread in the middle of a parallel region (which holds up the whole region)
and the step never takes the serving threads' core. With as many threads as cores nothing is
pinned: the serving work has to share the compute cores anyway, and the scheduler places it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Optional

log = logging.getLogger("kiln.runtime")
_ENV = "OMP_NUM_THREADS"
_layout: Optional[tuple[list[int], list[int]]] = None   # (compute, serving) cores, if split


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def claim_process(threads: Optional[int] = None) -> int:
    """Make every thread of this process compute single-threaded, except the engine's, which
    gets `threads` (default: OMP_NUM_THREADS if set, else this process's cores). Call before
    torch is imported; returns the engine's thread count."""
    n = threads or int(os.environ.get(_ENV) or 0) or available_cores()
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    if "torch" in sys.modules:
        log.warning("torch was imported before the compute threads were laid out: threads "
                    "other than the engine's may run multi-threaded regions and slow its step")
    os.environ[_ENV] = "1"
    _split_cores(n)
    return n


def _split_cores(threads: int) -> None:
    """With fewer compute threads than cores: this thread (and the threads it starts) on the
    cores the engine does not get; enter_engine_thread moves the engine onto the others."""
    global _layout
    try:
        serving = serving_cores(threads)
    except (AttributeError, OSError):    # no affinity calls here (not Linux): nothing pinned
        return
    if serving is None:
        _layout = None
        return
    _layout = (sorted(os.sched_getaffinity(0))[:threads], serving)
    os.sched_setaffinity(0, _layout[1])    # pid 0: the calling thread only
    log.info("compute cores %s, serving cores %s", *_layout)


def serving_cores(threads: int) -> Optional[list[int]]:
    """The cores a server given `threads` compute threads keeps for its serving threads (None
    when it does not split them): where a benchmark's client on the same host belongs."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[threads:] if threads < len(cores) else None


def pin_process(cores: list[int]) -> None:
    """Every thread of this process (and the threads they start) on `cores`. Linux only."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):   # a thread that just ended
            pass


def core_layout() -> Optional[tuple[list[int], list[int]]]:
    """(compute cores, serving cores) when claim_process split them, else None."""
    return _layout


def name_os_thread(name: str) -> None:
    """Name the calling thread in the OS (15 bytes at most), as `top -H`, `ps -L` and
    /proc/PID/task/TID/comm show it; threads it starts afterwards inherit the name (the
    engine thread's OpenMP workers). Python's thread names stay inside Python. Linux only;
    elsewhere nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def enter_engine_thread(threads: Optional[int]) -> None:
    """On the engine thread, before its first step: its name in the OS and its OpenMP/ATen
    thread count."""
    name_os_thread("kiln-engine")
    if _layout is not None:   # before its OpenMP workers exist: they inherit it
        os.sched_setaffinity(0, _layout[0])
    if threads:
        import torch

        torch.set_num_threads(threads)
