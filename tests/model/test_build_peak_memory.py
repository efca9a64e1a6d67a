"""A tiny build's memory accounting: the log's peak RSS per stage, the manifest's build record,
the refusal of a build that cannot fit, the streaming load's plan equal to the eager one's."""
import io
import json

import pytest

from kiln.builder.build import build
from kiln.builder.progress import Progress
from kiln.runtime.plan import read_manifest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def logged_build(tiny_spec_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("mem") / "plan"
    log = io.StringIO()
    res = build(tiny_spec_path, out, force=True, progress=Progress(stream=log))
    return res, log.getvalue()


def test_build_log_carries_peak_rss_per_stage(logged_build):
    res, log = logged_build
    stages = [ln for ln in log.splitlines() if ln.startswith("  ")]
    assert any(ln.startswith("  loading weights") for ln in stages)
    assert stages and all(", peak RSS " in ln and ln.endswith(" GiB at its end)")
                          for ln in stages)
    assert "builder peak RSS" in log.splitlines()[-1]


def test_manifest_records_peak_rss_and_plan_bytes(logged_build):
    res, _ = logged_build
    m = read_manifest(res.path)
    assert m.build is not None
    assert m.build.plan_bytes == m.total_bytes
    assert 100 << 20 < m.build.peak_rss_bytes < 64 << 30
    assert json.loads((res.path / "plan.json").read_text())["build"]["plan_bytes"] > 0


def test_tiny_build_streams_its_weights(logged_build):
    res, log = logged_build
    assert "one tensor at a time" in log
    assert read_manifest(res.path).build.streamed


def test_build_that_cannot_fit_is_refused_before_any_work(tiny_spec_path, tmp_path):
    from kiln.builder.build import BuildError

    out = tmp_path / "plans" / "p"
    with pytest.raises(BuildError, match=r"tiny-random: this checkpoint is larger than this "
                       r"machine can build: needs ~1\.\d\d GiB: 0\.00 B parameters, weights "
                       r"0\.00 GiB fp32, .*; 0\.00 GiB available \(--max-memory\)"):
        build(tiny_spec_path, out, force=True, max_memory=1 << 20)
    assert not (tmp_path / "plans").exists()


def test_build_whose_plan_cannot_fit_on_the_disk_is_refused_before_any_work(tiny_spec_path,
                                                                            tmp_path,
                                                                            monkeypatch):
    from types import SimpleNamespace

    from kiln.builder.build import BuildError

    out = tmp_path / "plans" / "p"
    monkeypatch.setattr("shutil.disk_usage",
                        lambda path: SimpleNamespace(total=1 << 40, used=1 << 40, free=4096))
    with pytest.raises(BuildError, match=rf"tiny-random: the plan will not fit on the disk that "
                       rf"holds {tmp_path}: it needs ~0\.\d\d GiB \(weights ~0\.00 GiB, engine, "
                       r"kernels and tokenizer\) and 0\.00 GiB is free"):
        build(tiny_spec_path, out, force=True)
    assert not (tmp_path / "plans").exists()


@pytest.mark.parametrize("error", ["enospc", "short-write"])
def test_a_disk_filling_up_mid_build_leaves_nothing_behind_and_says_so(logged_build, tmp_path,
                                                                       tiny_spec_path,
                                                                       monkeypatch, error):
    """The disk full once the engine is compiled (ENOSPC, or a writer's short write with no
    room left, as torch's archive writer reports it): the partial build is removed, the plan
    that was at the output stays as it was (it still verifies), and the error says so."""
    import errno
    import os
    import shutil
    from types import SimpleNamespace

    from kiln.builder import build as build_mod
    from kiln.builder.build import BuildError
    from kiln.runtime.plan import load_plan

    out = tmp_path / "p"
    shutil.copytree(logged_build[0].path, out)
    before = sorted((f.relative_to(out), f.stat().st_size) for f in out.rglob("*"))
    free = [1 << 40]
    monkeypatch.setattr("shutil.disk_usage",
                        lambda path: SimpleNamespace(total=1 << 40, used=0, free=free[0]))

    def full(model, tmp, engine):
        free[0] = 0
        if error == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "weights.bin"))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9 vs 7")
    monkeypatch.setattr(build_mod, "_share_weights", full)
    detail = (r"No space left on device: .*weights\.bin" if error == "enospc"
              else r"\[enforce fail at inline_container\.cc:672\] \. unexpected pos 9 vs 7")
    with pytest.raises(BuildError, match=rf"tiny-random: the disk that holds {tmp_path} filled "
                       rf"up while the plan was written \({detail}; the plan needs ~0\.06 GiB, "
                       rf"the disk had room for 0\.0\d GiB\); the partial build was removed "
                       rf"and {out} is as it was") as e:
        build(tiny_spec_path, out, force=True)
    assert e.value.abandon_process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]      # no .p.building-PID
    assert sorted((f.relative_to(out), f.stat().st_size) for f in out.rglob("*")) == before
    load_plan(out)


def test_other_failures_are_not_taken_for_a_full_disk(logged_build, tmp_path, tiny_spec_path,
                                                      monkeypatch):
    from kiln.builder import build as build_mod

    def broken(model, tmp, engine):
        raise RuntimeError("unexpected pos 9 vs 7")     # a short write with room to spare
    monkeypatch.setattr(build_mod, "_share_weights", broken)
    with pytest.raises(RuntimeError, match="unexpected pos") as e:
        build(tiny_spec_path, tmp_path / "p", force=True)
    assert type(e.value) is RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_cli_max_memory_and_env(tiny_spec_path, tmp_path):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kiln.cli", "build", str(tiny_spec_path), "--force",
           "--out", str(tmp_path / "p")]
    r = subprocess.run(cmd + ["--max-memory", "64MiB"], capture_output=True, text=True)
    assert r.returncode == 1 and "0.06 GiB available (--max-memory)" in r.stderr, r.stderr
    env = dict(os.environ, KILN_BUILD_MAX_MEMORY="32MiB")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "0.03 GiB available (KILN_BUILD_MAX_MEMORY)" in r.stderr
    r = subprocess.run(cmd + ["--max-memory", "lots"], capture_output=True, text=True)
    assert r.returncode == 2 and "--max-memory='lots'" in r.stderr
    assert not (tmp_path / "p").exists()


def test_an_uncached_reference_does_not_count_the_fp32_model(tmp_path, monkeypatch):
    """The reference runs one layer at a time (builder/layerwise_reference.py): only
    calibration holds the whole fp32 model."""
    from kiln.builder.accuracy_reference import Gate
    from kiln.builder.memory import build_estimate
    from kiln.builder.sources import open_checkpoint
    from kiln.builder.spec import parse_spec
    from tests.helpers import TINY_SPEC

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # no cached reference
    gated = parse_spec(TINY_SPEC + "precision: {weights: int8}\n")
    ckpt = open_checkpoint(gated.model)
    est = build_estimate(gated, ckpt)
    assert not Gate(gated, ckpt).reference_cached()
    assert est.whole_fp32 == "" and "accuracy reference" not in est.why
    assert build_estimate(parse_spec(TINY_SPEC), ckpt).whole_fp32 == ""     # not gated
    calibrated = parse_spec(TINY_SPEC + "precision: {weights: int4}\n"
                            "accuracy: {calibration_text: pydoc}\n")
    assert build_estimate(calibrated, ckpt).whole_fp32 == "quantize"


def test_a_refused_build_does_not_hash_the_weights(tmp_path, monkeypatch):
    """The refusal comes before anything reads the weights: the checkpoint's digest (which
    reads every byte: 55 s for 16 GB) is computed only when the build goes on."""
    import yaml

    from kiln.builder.build import BuildError
    from kiln.builder.sources import hf
    from tests.model.test_sources import _hf_model, _write_tokenizer

    d = tmp_path / "tiny-hf"
    _hf_model("llama", {}).save_pretrained(d)
    _write_tokenizer(d)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "tiny-hf", "model": {"source": str(d)}, "target": {"device": "cpu"},
        "limits": {"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 32},
        "kv_cache": {"tokens_per_block": 16, "memory": "2MiB"}}))

    def hashed(*a, **k):
        raise AssertionError("the weights were hashed")
    monkeypatch.setattr(hf, "files_sha256", hashed)
    with pytest.raises(BuildError, match="larger than this machine can build"):
        build(spec, tmp_path / "plans" / "p", max_memory=1 << 20)
    with pytest.raises(AssertionError, match="hashed"):     # a build that goes on hashes them
        build(spec, tmp_path / "plans" / "p", max_memory=1 << 40)
