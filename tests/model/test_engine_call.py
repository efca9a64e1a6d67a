"""A CPU plan's compiled step is called without the GIL (plugins/engine_call): while the
engine thread steps, other Python threads (kiln serve's event loop and post thread) run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]

# Both scripts: argv[1] the plan; one sequence of three tokens in block 1 of a small KV pool.
PROLOGUE = """
import sys, threading
from kiln.runtime.compute import claim_process
claim_process(1)
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import load_plan
plan = load_plan(sys.argv[1])
ex = Executor.from_plan(plan, kv_budget_bytes=1 << 20)
bs = plan.manifest.kv_cache.tokens_per_block
batch = ModelInput.build([[1, 2, 3]], [0], [[1]], bs)
"""

# The engine thread steps until told to stop (at most `limit` steps). The switch interval is
# made far longer than the test, so the main thread gets the GIL back only when the engine
# thread gives it up on its own: if the step held it, the main thread would resume only once
# the engine thread's loop had ended, and find it no longer alive.
STEP_LOOP = PROLOGUE + """
logits = ex.execute(batch).clone()
started, stop, steps = threading.Event(), [False], [0]
def loop(limit=int(sys.argv[2])):
    started.set()
    while not stop[0] and steps[0] < limit:
        ex.execute(batch)
        steps[0] += 1
sys.setswitchinterval(1000.0)
t = threading.Thread(target=loop)
t.start()
started.wait()
alive = t.is_alive()
stop[0] = True
t.join()
import hashlib
digest = hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()
print(sys.argv[3], alive, steps[0], type(ex.step_fn.engine).__name__, digest)
"""


# The main thread takes the GIL as the engine thread gives it up entering the step, and keeps it
# (no call in its loop gives it up) while it watches the last layer's V row of the step's last
# token in the KV pool. The step writes that row only after every layer has run: it is seen
# if the step runs to its end without taking the GIL back. Before engine_call.cpp held its
# inputs, the step took the GIL as it freed each input (the KV pools of layer 0 onward), and
# the row was never written while the main thread held it.
STEP_TO_ITS_END = PROLOGUE + """
import ctypes, time
ex.execute(batch)
for pool in ex.k_caches + ex.v_caches:
    pool.zero_()
row = ex.v_caches[-1][1, 2]          # block 1, offset 2: the third token, last layer
probe = (ctypes.c_ubyte * (row.numel() * row.element_size())).from_address(row.data_ptr())
sys.setswitchinterval(1000.0)
t = threading.Thread(target=ex.execute, args=(batch,))
t.start()                            # returns once the engine thread gave up the GIL
deadline, written = time.monotonic() + 60, False
while not written and time.monotonic() < deadline:
    written = any(bytes(probe))
sys.setswitchinterval(0.005)
t.join()
print(sys.argv[2], written, any(bytes(probe)))
"""


def _script(script: str, *args) -> list[str]:
    """The fields of the line the script prints (after "RESULT"), run in a fresh process."""
    r = subprocess.run([sys.executable, "-c", script, *map(str, args), "RESULT"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1].split()


def test_the_step_runs_to_its_end_without_the_gil(tiny_plan):
    line = _script(STEP_TO_ITS_END, tiny_plan)
    assert line[2] == "True", "the step wrote nothing to the probed row: the probe is wrong"
    assert line[1] == "True", "the step stopped for the GIL before its last layer"


def _run(plan: Path, limit: int) -> tuple[bool, int, str, str]:
    """(engine thread still stepping when the main thread got the GIL, steps taken, the
    step's engine class, sha256 of the first step's logits), from a fresh process."""
    line = _script(STEP_LOOP, plan, limit)
    return line[1] == "True", int(line[2]), line[3], line[4]


def test_the_plan_ships_the_engine_call_library(tiny_plan):
    m = json.loads((tiny_plan / "plan.json").read_text())
    calls = [k for k in m["engine"]["kernels"] if k.endswith("kiln_engine_call.so")]
    assert len(calls) == 1 and calls[0] in m["files"]
    assert m["engine"]["kernel_paths"][calls[0]].startswith("engine call")


def test_other_threads_run_python_while_the_engine_steps(tiny_plan):
    alive, steps, engine, _ = _run(tiny_plan, 2000)
    assert engine == "_NoGilEngine"
    assert alive and steps < 2000


def test_a_plan_without_the_library_still_loads_and_gives_the_same_logits(tiny_plan, tmp_path):
    """Plans built before the library: the runtime falls back to torch's package loader, which
    runs the same compiled model (bit for bit) but holds the GIL for the step. Whether the main
    thread still gets in between steps depends on torch's other ops (most release the GIL) and
    on timing, so the fallback's GIL is not asserted here."""
    import shutil

    plan = tmp_path / "plan"
    shutil.copytree(tiny_plan, plan)
    m = json.loads((plan / "plan.json").read_text())
    lib = next(k for k in m["engine"]["kernels"] if k.endswith("kiln_engine_call.so"))
    m["engine"]["kernels"].remove(lib)
    m["engine"]["kernel_paths"].pop(lib)
    m["files"].pop(lib)
    (plan / lib).unlink()
    (plan / "plan.json").write_text(json.dumps(m))
    *_, engine, digest = _run(plan, 50)
    assert engine == "_LoaderEngine"
    assert digest == _run(tiny_plan, 1)[3]
