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
