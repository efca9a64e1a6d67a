"""The CI templates in ci/ are valid YAML and call only kiln commands and options that exist."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kiln.cli import app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = [ROOT / "ci" / "github" / "kiln-plans.yml",
             ROOT / "ci" / "gitlab" / "kiln-plans.gitlab-ci.yml"]


SHELL_KEYS = ("run", "script", "before_script", "after_script")   # GitHub, GitLab


def _strings(node, shell: bool = False):
    """The shell command strings of a CI document (under run / script keys)."""
    if isinstance(node, str):
        if shell:
            yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, shell or k in SHELL_KEYS)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, shell)


def kiln_invocations(doc) -> list[list[str]]:
    """Every `kiln ...` command line in the template's strings, as argv after `kiln`."""
    found = []
    for s in _strings(doc):
        for m in re.finditer(r"(?:^|[;&|(\s])kiln\s+([^\n;&|>)]*)", s.replace("\\\n", " ")):
            found.append(shlex.split(m.group(1).replace("${{", "X").replace("}}", "X")))
    return found


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_is_yaml_with_kiln_commands_that_exist(path):
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    calls = kiln_invocations(doc)
    assert {tuple(c[:2]) for c in calls} >= {("ci", "plan"), ("ci", "rebuild")}
    runner = CliRunner()
    for argv in calls:
        words = [w for w in argv if not w.startswith("-")][:2]  # e.g. ci rebuild
        r = runner.invoke(app, [*words, "--help"])
        assert r.exit_code == 0, f"kiln {' '.join(words)}: {r.output}"
        for opt in (w.split("=")[0] for w in argv if w.startswith("--")):
            assert opt in r.output, f"kiln {' '.join(words)} has no option {opt}"


def test_github_workflow_triggers_and_matrix():
    doc = yaml.safe_load(TEMPLATES[0].read_text())
    on = doc.get("on", doc.get(True))     # YAML 1.1 reads a bare `on` key as True
    assert on["push"]["paths"] == ["model_specs/**"] and "schedule" in on
    build = doc["jobs"]["build"]
    assert "fromJSON(needs.plan.outputs.matrix)" in build["strategy"]["matrix"]
    assert "matrix.target" in build["runs-on"]
    uses = [s.get("uses", "") for s in build["steps"]]
    assert any(u.startswith("actions/cache") for u in uses)
    assert sum(u.startswith("actions/upload-artifact") for u in uses) == 2


def test_gitlab_job_rules_and_cache():
    doc = yaml.safe_load(TEMPLATES[1].read_text())
    rules = doc[".kiln-rules"]["rules"]
    assert any("schedule" in r["if"] for r in rules)
    assert any(r.get("changes") == ["model_specs/**/*"] for r in rules)
    job = doc["kiln-build"]
    assert job["cache"]["paths"] == ["kiln-store/"] and "KILN_TARGET" in job["cache"]["key"]
    assert job["parallel"]["matrix"][0]["KILN_TARGET"] == ["cpu"]
