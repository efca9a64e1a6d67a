"""The serving process's thread layout helpers (runtime/compute.py)."""
import sys
import threading
from pathlib import Path

import pytest

from runtime.compute import name_os_thread

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
