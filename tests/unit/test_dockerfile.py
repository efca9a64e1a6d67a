"""The server image (Dockerfile, not built here): its one install step is scripts/setup.sh,
the script the README's quick start and CI run; it serves as the non-root user the chart
expects, with the chart's command, from the venv setup.sh makes, and never bakes a plan in."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kiln.contracts import KILN_VERSION
from kiln.runtime.tools.chart_templates import DEPLOYMENT

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SETUP = "scripts/setup.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def calls_setup(script: str) -> bool:
    return any(shlex.split(line)[-1:] == [SETUP] or f"bash {SETUP}" in line
               for line in script.splitlines() if not line.lstrip().startswith("#"))


def test_the_install_step_is_the_script_ci_and_the_readme_run():
    runs = [args for word, args in instructions() if word == "RUN"]
    installs = [r for r in runs if SETUP in r]
    assert len(installs) == 1 and calls_setup(installs[0]), runs
    for r in runs:       # nothing installed beside it: no package manager of its own
        assert not re.search(r"\b(pip|pip3|apt-get|apt|conda|uv)\s+install\b", r), r
    assert calls_setup((ROOT / "scripts/test.sh").read_text())     # CI: .ci/run -> test.sh
    assert "scripts/test.sh" in (ROOT / ".ci/run").read_text()
    assert calls_setup((ROOT / "scripts/demo.sh").read_text())     # the README's quick start
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme


def test_it_serves_as_the_charts_non_root_user_from_setups_venv():
    steps = instructions()
    words = [w for w, _ in steps]
    user = [a for w, a in steps if w == "USER"]
    assert user and user[-1] not in ("root", "0", "0:0")
    uid, _, gid = user[-1].partition(":")
    assert f"runAsUser: {uid}" in DEPLOYMENT and f"runAsGroup: {gid}" in DEPLOYMENT
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    entry = json.loads(next(a for w, a in steps if w == "ENTRYPOINT"))
    assert f"command: {json.dumps(entry)}" in DEPLOYMENT
    workdir = next(a for w, a in steps if w == "WORKDIR")
    env = " ".join(a for w, a in steps if w == "ENV")
    assert f"PATH={workdir}/.venv/bin:" in env       # setup.sh makes ./.venv
    assert "HOME=/tmp" in env                        # the only writable place in the pod
    assert f"kiln-server:{KILN_VERSION}" in (ROOT / "Dockerfile").read_text()  # chart's image


def test_the_build_context_leaves_out_plans_and_the_hosts_venv():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {"plans", ".venv", ".git"} <= ignored
