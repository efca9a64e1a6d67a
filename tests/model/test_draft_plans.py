"""Draft-model speculative decoding with built plans: a tiny fp32 target whose spec names an
int8 plan of the same random weights as its draft. The build checks the draft and records
its fingerprint; the engine loads it beside the target; greedy output is the target's token
for token. A draft of another tokenizer, vocabulary, max_seq_len or batch is refused at
build; a missing, tampered or other draft plan is refused at load."""
from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from kiln.builder.build import build
from kiln.builder.draft import draft_current
from kiln.builder.progress import Progress
from kiln.builder.spec import SpecError, load_spec
from kiln.runtime.engine import Engine
from kiln.runtime.plan import PlanError, read_manifest
from kiln.runtime.sampling import SamplingParams
from tests.conftest import TEST_PLANS
from tests.model.test_quant_plans import PRECISIONS, tiny_spec, write_spec

pytestmark = pytest.mark.model

QUIET = Progress(enabled=False)


@pytest.fixture(scope="module")
def draft_plan(tmp_path_factory):
    """The tiny int8 plan (test_quant_plans' spec, so the plan is shared)."""
    spec = write_spec(tmp_path_factory.mktemp("draft"), tiny_spec("tiny-int8",
                                                                  *PRECISIONS["int8"]))
    return build(spec, TEST_PLANS / "tiny-int8", progress=QUIET).path


def _target_spec(dir, draft, name="tiny-draft-target", limits=None, arch=None, **speculative):
    data = tiny_spec(name, {"weights": "fp32"}, arch=arch)
    data["limits"].update(limits or {})
    data["speculative"] = {"method": "draft", "draft_plan": str(draft), "max_draft_tokens": 4,
                           "max_batch": 4, **speculative}
    return write_spec(dir, data)


@pytest.fixture(scope="module")
def target_plan(draft_plan, tmp_path_factory):
    spec = _target_spec(tmp_path_factory.mktemp("target"), draft_plan)
    return build(spec, TEST_PLANS / "tiny-draft-target", progress=QUIET).path


def _prompts():
    return [[5, 9, 13] * 6, [100 + i % 7 for i in range(30)], [3, 1, 4, 1, 5, 9, 2, 6],
            list(range(60, 90)), [42]]


def test_target_records_draft_and_output_is_identical(target_plan, draft_plan):
    from kiln.runtime.tools.inspect import describe

    m = read_manifest(target_plan)
    draft = read_manifest(draft_plan)
    rec = m.speculative.draft
    assert (rec.name, rec.fingerprint) == ("tiny-int8", draft.fingerprint)
    assert (target_plan / rec.path).resolve() == draft_plan.resolve()
    assert m.fingerprint_inputs["draft"] == draft.fingerprint
    assert re.search(rf"^draft plan +tiny-int8  {re.escape(rec.path)}  fingerprint "
                     rf"{draft.fingerprint}$", describe(m, target_plan), re.M)
    line = re.search(r"^speculative +(.*)$", describe(m, target_plan), re.M).group(1)
    assert line.startswith("method=draft, max_draft_tokens=") and "ngram" not in line, line
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = _prompts()[:4]      # max_batch 4: once prefilled, all four speculate
    with Engine.from_plan(target_plan, speculative=False) as plain:
        want = plain.generate(prompts, params)
        assert plain.drafter is None
    with Engine.from_plan(target_plan) as spec:
        got = spec.generate(prompts, params)
        stats, drafter = spec.stats(), spec.drafter
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert drafter.num_steps > 0 and drafter.num_blocks_used == 0
    assert stats["kv_blocks_used"] == 0


def test_package_carries_the_draft_and_the_unpacked_plan_speculates(target_plan, draft_plan,
                                                                      tmp_path):
    """`kiln package` of a plan that drafts with a draft plan puts both in the image's layer,
    side by side under models/, so the unpacked plan finds its draft where it recorded it."""
    import tarfile

    from kiln.runtime.tools.package import PackageError, load_packaged, package_plan

    out = package_plan(target_plan, tmp_path / "oci")
    layer = tmp_path / "oci" / "blobs" / "sha256" / out.layer.digest.removeprefix("sha256:")
    with tarfile.open(layer) as tar:
        names = set(tar.getnames())
    assert {"models/tiny-draft-target/plan.json", "models/tiny-int8/plan.json"} <= names
    plan = load_packaged(tmp_path / "oci", tmp_path / "unpacked", expect_digest=out.plan_digest)
    assert plan.path == tmp_path / "unpacked" / "tiny-draft-target"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = _prompts()[:4]
    with Engine.from_plan(target_plan, speculative=False) as plain:
        want = plain.generate(prompts, params)
    with Engine.from_plan(plan.path) as spec:
        got = spec.generate(prompts, params)
        assert spec.drafter is not None and spec.stats()["spec_draft_tokens"] > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # a draft that is not the one the plan was built against is never packaged
    moved = tmp_path / "moved"
    shutil.copytree(target_plan, moved / "tiny-draft-target")
    shutil.copytree(draft_plan, moved / "tiny-int8")
    data = json.loads((moved / "tiny-int8" / "plan.json").read_text())
    data["fingerprint"] = "0" * 64
    (moved / "tiny-int8" / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="was built against tiny-int8"):
        package_plan(moved / "tiny-draft-target", tmp_path / "oci2")


def test_rebuilt_draft_makes_the_target_stale(target_plan, tmp_path):
    spec_path = _target_spec(tmp_path, "unused")
    m = read_manifest(target_plan)
    other = tmp_path / "other-draft"
    shutil.copytree(target_plan / m.speculative.draft.path, other)
    assert draft_current(load_spec(_target_spec(tmp_path, other)), spec_path, m)
    data = json.loads((other / "plan.json").read_text())
    data["fingerprint"] = "0" * 64
    (other / "plan.json").write_text(json.dumps(data))
    assert not draft_current(load_spec(_target_spec(tmp_path, other)), spec_path, m)


def test_kiln_ci_fingerprints_the_draft_as_the_build_does(target_plan, draft_plan, tmp_path):
    from kiln.builder.plan_ci.assess import _fingerprint

    spec_path = _target_spec(tmp_path, draft_plan)
    fp, inputs, error = _fingerprint(load_spec(spec_path), spec_path)
    assert error is None and inputs["draft"] == read_manifest(draft_plan).fingerprint
    assert fp == read_manifest(target_plan).fingerprint


def _refused(spec_path, *needles):
    with pytest.raises(SpecError) as e:
        build(spec_path, spec_path.parent / "out", progress=QUIET)
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert "speculative.draft_plan" in str(e.value)
    assert not (spec_path.parent / "out").exists()


def test_build_refuses_a_draft_of_smaller_max_seq_len(draft_plan, tmp_path):
    _refused(_target_spec(tmp_path, draft_plan, limits={"max_seq_len": 512}),
             "limits.max_seq_len: the draft has 256, below the target's 512")


def test_build_refuses_a_draft_of_another_vocabulary(draft_plan, tmp_path):
    arch = {**tiny_spec("x", {})["model"]["arch"], "vocab_size": 320}
    _refused(_target_spec(tmp_path, draft_plan, arch=arch),
             "vocab_size: the draft has 384, the target 320", "tokenizer")


def test_build_refuses_a_draft_of_smaller_batch(draft_plan, tmp_path):
    limits = {"max_batch_size": 16, "max_num_tokens": 128}
    _refused(_target_spec(tmp_path, draft_plan, limits=limits, max_batch=16),
             "limits.max_batch_size: the draft has 8, below the 16 sequences")


def test_build_refuses_a_draft_of_another_tokenizer(draft_plan, tmp_path):
    """A consistent plan (every sha256 right) whose tokenizer maps two tokens the other way."""
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_plan, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    raw = json.dumps(tok).encode()
    (other / "tokenizer.json").write_bytes(raw)
    plan = json.loads((other / "plan.json").read_text())
    plan["files"]["tokenizer.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (other / "plan.json").write_text(json.dumps(plan))
    read_manifest(other)   # a well-formed plan
    _refused(_target_spec(tmp_path, other), "tokenizer.json differs in model",
             "2 entries differ")


def test_build_refuses_a_missing_draft(tmp_path):
    _refused(_target_spec(tmp_path, tmp_path / "nowhere"), "cannot be loaded",
             "not a plan directory")


def test_load_refuses_a_tampered_draft(target_plan, draft_plan, tmp_path):
    copy = tmp_path / "tampered"
    shutil.copytree(draft_plan, copy)
    raw = bytearray((copy / "tokenizer.json").read_bytes())
    raw[-3] ^= 1
    (copy / "tokenizer.json").write_bytes(bytes(raw))
    with pytest.raises(PlanError, match=r"draft plan .* cannot be loaded: .*corrupt: "
                                        r"tokenizer.json does not match its sha256"):
        Engine.from_plan(target_plan, start=False, draft_plan=copy)


def test_load_refuses_a_draft_of_another_fingerprint(target_plan, tiny_plan):
    with pytest.raises(PlanError, match=r"has fingerprint .* was built against .* Rebuild "
                                        r"the target against this draft"):
        Engine.from_plan(target_plan, start=False, draft_plan=tiny_plan)


def test_load_refuses_a_missing_draft(target_plan, tmp_path):
    with pytest.raises(PlanError, match="cannot be loaded: .* not a plan directory"):
        Engine.from_plan(target_plan, start=False, draft_plan=tmp_path / "gone")


def test_serve_loads_the_recorded_draft_or_the_one_named(target_plan, draft_plan, tmp_path):
    """`kiln serve PLAN` loads the draft the plan records; `--draft-plan DIR` another copy
    of it; `--draft-plan` on a plan served without draft speculation is refused before
    anything loads."""
    from kiln.runtime.server.app import ServeConfig, ServeError, _load, check_config

    moved = tmp_path / "moved-draft"
    shutil.copytree(draft_plan, moved)
    for cfg, where in ((ServeConfig(plan=target_plan), draft_plan),
                       (ServeConfig(plan=target_plan, draft_plan=moved), moved)):
        check_config(cfg)
        engine, _ = _load(cfg)
        with engine:
            assert engine.drafter.plan_path.resolve() == where.resolve()
    with pytest.raises(ServeError, match="--draft-plan .*: a draft plan serves a plan built "
                                         "with speculative method draft; this plan's "
                                         "speculation is off"):
        check_config(ServeConfig(plan=target_plan, speculative="off", draft_plan=moved))
