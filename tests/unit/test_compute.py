"""The serving process's thread layout helpers (runtime/compute.py)."""
import sys
import threading
from pathlib import Path

import pytest

from kiln.runtime.compute import name_os_thread

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")
def test_a_named_thread_shows_its_name_in_proc_and_names_are_cut_to_15_bytes():
    seen = {}

    def run(name):
        name_os_thread(name)
        tid = threading.get_native_id()
        seen[name] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()

    for name in ("kiln-engine", "a-name-longer-than-fifteen"):
        t = threading.Thread(target=run, args=(name,))
        t.start()
        t.join()
    assert seen == {"kiln-engine": "kiln-engine", "a-name-longer-than-fifteen": "a-name-longer-t"}
    assert Path("/proc/self/comm").read_text().strip() != "kiln-engine"   # the caller's only


# A fresh process (claim_process changes the calling thread's cores and the process's env):
# prints the layout, the main thread's cores, an engine thread's and a serving thread's.
LAYOUT = """
import os, sys, threading
from kiln.runtime.compute import claim_process, core_layout, enter_engine_thread
n = claim_process(int(sys.argv[1]) or None)
seen = {}
def engine():
    enter_engine_thread(None)            # None: no torch import; the cores are still set
    seen["engine"] = sorted(os.sched_getaffinity(0))
    t = threading.Thread(target=lambda: seen.__setitem__("worker", sorted(os.sched_getaffinity(0))))
    t.start(); t.join()                  # a thread the engine starts (its OpenMP workers)
def serving():
    seen["serving"] = sorted(os.sched_getaffinity(0))
for f in (engine, serving):
    t = threading.Thread(target=f); t.start(); t.join()
print(n, core_layout(), sorted(os.sched_getaffinity(0)), seen["engine"], seen["worker"],
      seen["serving"])
"""


def _layout(threads: int) -> str:
    import os
    import subprocess
    r = subprocess.run([sys.executable, "-c", LAYOUT, str(threads)], capture_output=True,
                       text=True, cwd=Path(__file__).parents[2], timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity")
                    or len(__import__("os").sched_getaffinity(0)) < 2,
                    reason="needs two cores and the affinity calls (Linux)")
def test_fewer_compute_threads_than_cores_split_the_cores_and_all_cores_split_none():
    import os
    cores = sorted(os.sched_getaffinity(0))
    c0, rest = cores[:1], cores[1:]
    # one compute thread: the engine and the threads it starts on the first core, the
    # process's other threads (and the threads they start) on the rest
    assert _layout(1) == f"1 ({c0}, {rest}) {rest} {c0} {c0} {rest}"
    # as many as the cores: nothing pinned
    assert _layout(0) == f"{len(cores)} None {cores} {cores} {cores} {cores}"
