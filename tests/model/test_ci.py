"""kiln ci on three tiny eager specs in a temporary git repository.

    specs/a.yaml   random weights
    specs/b.yaml   the HF checkpoint ckpt/ (save_pretrained)
    specs/c.yaml   the same checkpoint, other limits

The first run (built once per module) is snapshotted; every test starts from a copy of that
snapshot restored at the same path (so absolute source paths and file mtimes, which the
spec and the quick key record, are unchanged).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kiln
import torch
from typer.testing import CliRunner

from kiln.builder.plan_ci.assess import find_specs
from kiln.builder.plan_ci.pipeline import CIOptions, rebuild
from kiln.builder.plan_ci.records import InputChange
from kiln.builder.plan_ci.report import render_markdown
from kiln.builder.plan_ci.store import PlanStore
from kiln.cli import app

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
ENV_BIN = Path(sys.executable).parent
VOCAB = 320
ARCH = """
name: {name}
model:
  source: {source}
{extra_model}target:
  device: cpu
  backend: eager
limits:
  max_batch_size: {batch}
  max_seq_len: 128
  max_num_tokens: 32
kv_cache:
  tokens_per_block: 16
  memory: 2MiB
golden:
  - prompt: "hello"
    max_tokens: 6
"""
RANDOM_MODEL = """  seed: 0
  arch:
    vocab_size: 320
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 1
    num_attention_heads: 2
    num_key_value_heads: 1
    max_position_embeddings: 256
"""


def spec_text(name: str, source: str, batch: int = 4, extra: str = "") -> str:
    extra_model = RANDOM_MODEL if source == "random" else ""
    return ARCH.format(name=name, source=source, batch=batch, extra_model=extra_model) + extra


def write_checkpoint(d: Path, seed: int) -> None:
    from kiln.builder.sources.tokenizer_build import byte_level

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    (d / "tokenizer.json").write_text(byte_level(VOCAB, 1, 2))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                         "bos_token": "<s>"}))


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


class Repo:
    def __init__(self, root: Path):
        self.root = root
        self.specs = root / "model_specs"
        self.store = PlanStore(root / "kiln-store")

    def run(self, **kw):
        log = io.StringIO()
        t = time.perf_counter()
        report = rebuild(find_specs(self.specs), CIOptions(store=self.store.root, **kw), log)
        report.wall = time.perf_counter() - t
        report.log = log.getvalue()
        return report

    def write_spec(self, stem: str, text: str) -> None:
        (self.specs / f"{stem}.yaml").write_text(text)
        git(self.root, "commit", "-qam", f"edit {stem}")


def by_name(report) -> dict:
    return {s.name or Path(s.spec_path).stem: s for s in report.specs}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The repository after the first run, its report, and a snapshot to restore."""
    torch.set_num_threads(1)
    top = tmp_path_factory.mktemp("ci")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(top / "cache"))   # digest cache of this test only
    root = top / "repo"
    (root / "model_specs").mkdir(parents=True)
    write_checkpoint(root / "ckpt", seed=0)
    git(root, "init", "-q")
    repo = Repo(root)
    (repo.specs / "a.yaml").write_text(spec_text("tiny-a", "random"))
    (repo.specs / "b.yaml").write_text(spec_text("tiny-b", "../ckpt"))
    (repo.specs / "c.yaml").write_text(spec_text("tiny-c", "../ckpt", batch=2))
    git(root, "add", ".")
    git(root, "commit", "-qm", "specs")
    first = repo.run()
    snapshot = top / "snapshot"
    shutil.copytree(root, snapshot, symlinks=True)
    yield repo, first, snapshot
    mp.undo()


@pytest.fixture
def repo(base):
    repo, _, snapshot = base
    shutil.rmtree(repo.root)
    shutil.copytree(snapshot, repo.root, symlinks=True)   # copy2: mtimes kept
    return repo


def test_first_run_builds_all(base):
    repo, first, _ = base
    res = by_name(first)
    assert {n: s.status for n, s in res.items()} == dict.fromkeys(
        ["tiny-a", "tiny-b", "tiny-c"], "rebuilt"), first.log
    assert first.ok
    for name, s in res.items():
        assert s.reason == "new spec (no current plan)"
        assert repo.store.current(name) == s.fingerprint and repo.store.has(s.fingerprint)
        assert s.plan_bytes > 0 and s.build_seconds > 0 and s.verify.startswith("ok")
    assert not list(repo.store.staging.iterdir())
    md = render_markdown(first)
    assert "3 specs: 3 rebuilt, 0 reused, 0 failed" in md and "| tiny-b | rebuilt |" in md
    print(f"first run: {first.wall:.1f} s")


def test_second_run_rebuilds_nothing(repo):
    report = repo.run()
    assert {s.status for s in report.specs} == {"reused"}, report.log
    assert all(s.reason == "unchanged" for s in report.specs)
    print(f"second run: {report.wall:.2f} s")


def test_dry_run_cli_imports_no_torch(repo):
    code = ("import json, sys, time\n"
            "t = time.perf_counter()\n"
            "from typer.testing import CliRunner\n"
            "from kiln.cli import app\n"
            f"r = CliRunner().invoke(app, ['ci', 'plan', '--specs', {str(repo.specs)!r}, "
            f"'--store', {str(repo.store.root)!r}, '--json'])\n"
            "print(json.dumps({'out': r.output, 'code': r.exit_code, "
            "'torch': 'torch' in sys.modules, 's': time.perf_counter() - t}))\n")
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "XDG_CACHE_HOME": str(repo.root.parent / "cache")})
    wall = time.perf_counter() - t
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["code"] == 0 and not res["torch"], res
    plan = json.loads(res["out"])
    assert plan["counts"] == {"reuse": 3, "build": 0, "fail": 0}
    assert plan["matrix"] == {"include": [{"target": "cpu"}]} and plan["build_targets"] == []
    print(f"dry run (python -c, whole process): {wall:.2f} s")


def test_edit_one_spec_rebuilds_exactly_it(repo):
    old_b = repo.store.current("tiny-b")
    rec = repo.store.record(old_b)
    hello = rec.verify.golden[0].text
    # same numerics (only the batch limit changes), so the golden tokens must agree exactly
    repo.write_spec("b", spec_text("tiny-b", "../ckpt", batch=3, extra="golden_agreement: 1.0\n")
                    .replace('max_tokens: 6\n', f'max_tokens: 6\n    expected: {json.dumps(hello)}\n'))
    report = repo.run()
    res = by_name(report)
    assert {n: s.status for n, s in res.items()} == {
        "tiny-a": "reused", "tiny-b": "rebuilt", "tiny-c": "reused"}, report.log
    b = res["tiny-b"]
    assert [c.input for c in b.changed] == ["spec"]
    assert "limits.max_batch_size: 4 -> 3" in b.changed[0].detail
    assert b.previous == old_b and repo.store.current("tiny-b") == b.fingerprint != old_b
    assert "agreement 1.00 (min 1.00)" in b.verify
    assert "matches expected" in b.verify_text

    # a rollback is a pointer move, both ways
    r = CliRunner().invoke(app, ["ci", "rollback", "tiny-b", "--store", str(repo.store.root)])
    assert r.exit_code == 0, r.output
    assert repo.store.current("tiny-b") == old_b
    again = by_name(repo.run())["tiny-b"]       # the rollback holds while the spec does
    assert again.status == "reused" and "rolled back to" in again.reason
    assert repo.store.current("tiny-b") == old_b
    r = CliRunner().invoke(app, ["ci", "rollback", "tiny-b", "--to", b.fingerprint[:10],
                                 "--store", str(repo.store.root)])
    assert r.exit_code == 0, r.output
    assert repo.store.current("tiny-b") == b.fingerprint


def test_replaced_weights_rebuild_the_specs_using_them(repo):
    shutil.rmtree(repo.root / "ckpt")
    write_checkpoint(repo.root / "ckpt", seed=1)
    report = repo.run()
    res = by_name(report)
    assert {n: s.status for n, s in res.items()} == {
        "tiny-a": "reused", "tiny-b": "rebuilt", "tiny-c": "rebuilt"}, report.log
    for n in ("tiny-b", "tiny-c"):
        assert [c.input for c in res[n].changed] == ["weights"]
    assert "**weights**: sha256" in render_markdown(report)


def test_toolchain_change_rebuilds_all(repo, monkeypatch):
    import kiln.builder.fingerprint as fpmod

    real = fpmod.toolchain
    monkeypatch.setattr(fpmod, "toolchain", lambda: {**real(), "kiln": "9.9.9-test"})
    report = repo.run(full=True)
    assert {s.status for s in report.specs} == {"rebuilt"}, report.log
    for s in report.specs:
        assert s.changed == [InputChange("toolchain", f"kiln: '{kiln.__version__}' -> '9.9.9-test'")]


def test_bad_spec_and_bad_checkpoint_fail_alone(repo):
    fp_a, fp_c = repo.store.current("tiny-a"), repo.store.current("tiny-c")
    repo.write_spec("a", spec_text("tiny-a", "random").replace("max_batch_size: 4",
                                                                 "max_batch_size: 0"))
    repo.write_spec("c", spec_text("tiny-c", "../no-such-ckpt", batch=2))
    r = CliRunner().invoke(app, ["ci", "rebuild", "--specs", str(repo.specs), "--store",
                                 str(repo.store.root), "--json", str(repo.root / "r.json"),
                                 "--report", str(repo.root / "r.md")])
    assert r.exit_code == 1, r.output
    data = json.loads((repo.root / "r.json").read_text())
    res = {Path(s["spec_path"]).stem: s for s in data["specs"]}
    assert res["a"]["status"] == "failed" and "limits.max_batch_size" in res["a"]["error"]
    assert res["b"]["status"] == "reused"
    assert res["c"]["status"] == "failed" and "no-such-ckpt" in res["c"]["error"]
    assert "no such file or directory" in res["c"]["error"]
    assert repo.store.current("tiny-a") == fp_a and repo.store.current("tiny-c") == fp_c
    md = (repo.root / "r.md").read_text()
    assert "### Failures" in md and "max_batch_size" in md and not data["ok"]


def test_failed_gate_leaves_previous_plan_current(repo):
    old = repo.store.current("tiny-a")
    plans_before = sorted(p.name for p in repo.store.plans.iterdir())
    repo.write_spec("a", spec_text("tiny-a", "random").replace(
        'max_tokens: 6\n', 'max_tokens: 6\n    expected: "certainly not this"\n'))
    report = repo.run()
    a = by_name(report)["tiny-a"]
    assert a.status == "failed" and not report.ok
    assert "DRIFT" in a.error and "expected: 'certainly not this'" in a.error
    assert repo.store.current("tiny-a") == old
    assert sorted(p.name for p in repo.store.plans.iterdir()) == plans_before
    assert not list(repo.store.staging.iterdir())
    assert {s.status for s in report.specs if s.name != "tiny-a"} == {"reused"}


def test_kiln_verify_cli(repo):
    plan = repo.store.plan_dir(repo.store.current("tiny-c"))
    r = CliRunner().invoke(app, ["verify", str(plan)])
    assert r.exit_code == 0, r.output
    assert "golden 1/1 'hello': ok (" in r.output and "result: ok" in r.output
    assert "accuracy: not applicable" in r.output


def test_oci_publishes_each_current_plans_image_beside_it(repo):
    """rebuild --oci: STORE/images/<fp>/ is the plan's OCI image, its manifest digest the
    one recorded in packages/<fp>.json (what `kiln ci current --oci-digest` prints); the next
    run leaves it, a damaged one is written again, and pruning a plan removes its image."""
    from kiln.runtime.tools.package import package_plan, read_layout

    report = repo.run(oci=True)
    assert report.ok, report.log
    for s in report.specs:
        layout = read_layout(repo.store.image_dir(s.fingerprint))   # every blob checked
        digest = repo.store.package(s.fingerprint)["manifest_digest"]
        assert layout.manifest.digest == digest and digest in report.log
        again = package_plan(repo.store.plan_dir(s.fingerprint), repo.root / s.name)
        assert again.manifest.digest == digest                     # deterministic
        r = CliRunner().invoke(app, ["ci", "current", s.name, "--oci-digest", "--store",
                                     str(repo.store.root)])
        assert r.exit_code == 0 and r.output.strip() == digest, r.output
    fp = by_name(report)["tiny-a"].fingerprint
    index = repo.store.image_dir(fp) / "index.json"
    second = repo.run(oci=True)
    assert "image already in the store for" in second.log and "packaged" not in second.log
    index.write_text("{}")
    third = repo.run(oci=True)
    assert f"tiny-a: packaged {fp[:12]}" in third.log, third.log
    assert read_layout(repo.store.image_dir(fp)).manifest.digest == \
        repo.store.package(fp)["manifest_digest"]
    repo.write_spec("a", spec_text("tiny-a", "random", batch=2))
    assert repo.run(oci=True, keep=1).ok
    assert not repo.store.image_dir(fp).exists() and repo.store.package(fp) is None
