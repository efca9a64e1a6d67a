"""A build killed before its cleanup (SIGKILL, the OOM killer, a CI timeout) leaves its
temporary directory beside the plan; the next build of that plan removes it."""
import os
import subprocess
import sys

import pytest

from kiln.builder.build import _sweep_stale

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_build_directories_of_dead_builds_are_removed(tmp_path):
    out = tmp_path / "plans" / "x"
    dead, live = _dead_pid(), os.getpid()
    for name in (f".x.building-{dead}", f".x.old-{dead}",   # a killed build of x: removed
                 f".x.building-{live}",                     # a running build of x: kept
                 f".y.building-{dead}",                     # another plan's: not this build's
                 ".x.building-notapid", "x"):               # not ours to judge; the plan itself
        (tmp_path / "plans" / name / "kernels").mkdir(parents=True)
    _sweep_stale(out)
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == sorted(
        [f".x.building-{live}", f".y.building-{dead}", ".x.building-notapid", "x"])


def test_output_lock_serializes_builds_and_leaves_no_file(tmp_path):
    """A second holder of an output's lock waits for the first; the lock file is gone after."""
    import threading
    import time

    from kiln.builder.build import _output_lock
    from kiln.builder.progress import Progress

    out = tmp_path / "plans" / "x"
    out.parent.mkdir()
    order, entered = [], threading.Event()

    def second():
        entered.wait()
        with _output_lock(out, Progress(enabled=False)):
            order.append("second")

    t = threading.Thread(target=second)
    with _output_lock(out, Progress(enabled=False)):
        assert (tmp_path / "plans" / ".x.lock").is_file()
        t.start()
        entered.set()
        time.sleep(0.3)             # the second holder is blocked on the lock by now
        order.append("first")
    t.join(timeout=10)
    assert order == ["first", "second"]
    assert list(out.parent.iterdir()) == []
