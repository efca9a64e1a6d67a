"""The build pipeline on a tiny random model: plan layout, caching, refusals, fingerprints."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.builder.build import build
from kiln.builder.fingerprint import build_target, fingerprint, fingerprint_inputs
from kiln.builder.spec import load_spec, parse_spec
from kiln.contracts import PLAN_FORMAT_VERSION
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import PlanError, load_plan

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def test_plan_layout(tiny_plan):
    m = json.loads((tiny_plan / "plan.json").read_text())
    assert m["format_version"] == PLAN_FORMAT_VERSION and m["name"] == "tiny-random"
    assert len(m["fingerprint"]) == 64
    for rel in ("engine.pt2", "weights.bin", "tokenizer.json", "generation.json"):
        assert rel in m["files"] and (tiny_plan / rel).is_file()
    assert m["engine"]["weights"]["file"] == "weights.bin"   # the engine file: code only
    assert any(k.startswith("kernels/") for k in m["files"])
    assert m["target"]["device"] == "cpu" and m["target"]["isa"]
    assert m["toolchain"]["torch"] == torch.__version__
    assert m["check"]["max_logit_diff"] <= 1e-3
    assert m["engine"]["backend"] == "aoti"
    assert m["limits"]["max_num_tokens"] == 64
    for meta in m["files"].values():
        assert meta["size"] > 0 and len(meta["sha256"]) == 64


def test_engine_call_checks_its_argument_layout_once(tiny_plan):
    """The runtime flattens the step's arguments itself (not through pytree each call); the
    first call checks that layout against the engine's input spec and names the mismatch; a
    refused call leaves the engine usable."""
    plan = load_plan(tiny_plan)
    ex = Executor.from_plan(plan)
    step = ex.step_fn
    inp = ModelInput.build([[1, 2, 3]], [0], [[1]], plan.manifest.kv_cache.tokens_per_block)
    with pytest.raises(PlanError, match="the engine takes inputs shaped"):
        step(*inp.args(), ex.k_caches[:-1], ex.v_caches)   # one layer's pool missing
    with torch.inference_mode():
        logits = step(*inp.args(), ex.k_caches, ex.v_caches)
    assert logits.shape == (1, plan.shape.vocab_size) and torch.isfinite(logits).all()


def test_compiled_plan_matches_eager_model(tiny_plan):
    """The AOTI engine and the eager model agree over several steps of a shared pool."""
    from kiln.builder.sources import load_model, open_checkpoint

    spec = load_spec(ROOT / "model_specs" / "tiny-random.yaml")
    model = load_model(open_checkpoint(spec.model)).eval()
    plan = load_plan(tiny_plan)
    ex = Executor.from_plan(plan)
    ref_pools = ([torch.zeros_like(k) for k in ex.k_caches], [torch.zeros_like(v) for v in ex.v_caches])
    g = torch.Generator().manual_seed(1)
    tables = [[5, 2, 9], [1, 7, 3], [4, 6, 8]]
    lens, starts = [20, 7, 33], [0, 0, 0]
    for _ in range(3):
        toks = [torch.randint(0, 384, (n,), generator=g).tolist() for n in lens]
        inp = ModelInput.build(toks, starts, tables, 16)
        got = ex.execute(inp)
        with torch.no_grad():
            ref = model(*inp.args(), *ref_pools)
        assert got.shape == (3, 384)
        assert (got - ref).abs().max().item() < 1e-3
        starts = [s + n for s, n in zip(starts, lens)]
        lens = [1, 1, 1]


def test_second_build_is_up_to_date(tiny_plan, tiny_spec_path):
    t = time.perf_counter()
    res = build(tiny_spec_path, tiny_plan)
    assert not res.rebuilt and res.reason == "up to date"
    print(f"up-to-date check: {time.perf_counter() - t:.2f} s")


def test_one_byte_changed_is_refused(tiny_plan, tmp_path):
    bad = tmp_path / "plan"
    shutil.copytree(tiny_plan, bad)
    f = bad / "tokenizer.json"
    data = bytearray(f.read_bytes())
    data[10] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(PlanError, match=r"tokenizer.json does not match its sha256.*kiln build"):
        load_plan(bad)


def copy_with_manifest(plan: Path, dst: Path, edit) -> Path:
    """A copy of `plan` whose manifest was changed by edit(manifest)."""
    shutil.copytree(plan, dst)
    m = json.loads((dst / "plan.json").read_text())
    edit(m)
    (dst / "plan.json").write_text(json.dumps(m))
    return dst


def test_plan_for_missing_isa_is_refused(tiny_plan, tmp_path):
    """A plan whose recorded features include one this CPU lacks is refused, naming it."""
    bad = copy_with_manifest(tiny_plan, tmp_path / "plan", lambda m: m["target"].update(
        isa="amx", cpu_features=m["target"]["cpu_features"] + ["amx_tile", "amx_fp8"]))
    with pytest.raises(PlanError) as e:
        load_plan(bad)
    msg = str(e.value)
    assert "compiled for CPU ISA amx" in msg and "this CPU lacks" in msg
    assert "amx_fp8" in msg and "kiln build" in msg


def test_plan_escaping_its_directory_is_refused_before_loading(tiny_plan, tmp_path):
    """engine/kernel entries outside the plan, or not checksummed, are refused by load_plan."""
    from kiln.runtime.executor import Executor

    evil = tmp_path / "x.so"
    evil.write_bytes(b"not a library")
    edits = {
        "parent": lambda m: m["engine"]["kernels"].append("../x.so"),
        "absolute": lambda m: m["engine"]["kernels"].append(str(evil)),
        "unlisted": lambda m: m["engine"].update(file="tokenizer.json") or
        m["files"].pop("tokenizer.json"),
        "files-entry": lambda m: m["files"].update({"../x.so": {"size": 13, "sha256": "0" * 64}}),
        "plugin": lambda m: m["engine"]["plugins"].append("..evil"),
    }
    for name, edit in edits.items():
        bad = copy_with_manifest(tiny_plan, tmp_path / name, edit)
        with pytest.raises(PlanError, match="refused"):
            Executor.from_plan(load_plan(bad))


def test_plan_for_other_torch_is_refused(tiny_plan, tmp_path):
    bad = copy_with_manifest(tiny_plan, tmp_path / "plan",
                             lambda m: m["toolchain"].update(torch="2.99.0"))
    with pytest.raises(PlanError, match=r"compiled with torch 2.99.0.*this runtime has torch"):
        load_plan(bad)


def test_plan_for_other_kernel_ops_is_refused(tiny_plan, tmp_path):
    """A plan whose kernels were compiled against other op schemas (or before they were
    recorded) is refused before its libraries load (torch would abort the process)."""
    assert json.loads((tiny_plan / "plan.json").read_text())["toolchain"]["ops"]
    for name, ops in (("other", "0123456789abcdef"), ("unrecorded", None)):
        edit = (lambda m, o=ops: m["toolchain"].update(ops=o) if o else
                m["toolchain"].pop("ops"))
        bad = copy_with_manifest(tiny_plan, tmp_path / name, edit)
        with pytest.raises(PlanError, match=r"kernel ops differ.*Rebuild") as e:
            load_plan(bad)
        assert e.value.field == "toolchain.ops"


def test_wrong_format_version_is_refused(tiny_plan, tmp_path):
    bad = copy_with_manifest(tiny_plan, tmp_path / "plan",
                             lambda m: m.update(format_version=99))
    with pytest.raises(PlanError, match="format version 99"):
        load_plan(bad)


def test_corrupt_manifest_names_the_field(tiny_plan, tmp_path):
    bad = copy_with_manifest(tiny_plan, tmp_path / "plan",
                             lambda m: m["limits"].update(max_num_tokens="64"))
    with pytest.raises(PlanError, match=r"limits.max_num_tokens.*expected int") as e:
        load_plan(bad)
    assert e.value.field == "limits.max_num_tokens"


def test_loading_a_plan_hashes_each_file_once(tiny_plan, monkeypatch):
    """load_plan reads and hashes the data files, the step loader the code files as it copies
    them; the tokenizer is built from the bytes load_plan read."""
    from kiln.runtime import plan as rplan
    from kiln.runtime.tokenizer import Tokenizer

    hashed = []
    read_verified, verified_copy = rplan.read_verified, rplan.verified_copy

    def read(path, rel, *a):
        hashed.append(rel)
        return read_verified(path, rel, *a)

    def copy(path, rel, *a):
        hashed.append(rel)
        return verified_copy(path, rel, *a)

    def mapped(path, section, expected):
        hashed.append(section.file)
        return map_weights(path, section, expected)
    map_weights = rplan.map_weights
    monkeypatch.setattr(rplan, "read_verified", read)
    monkeypatch.setattr(rplan, "verified_copy", copy)
    monkeypatch.setattr(rplan, "map_weights", mapped)
    monkeypatch.setattr(rplan, "sha256_file", None)   # nothing hashes a file by its path
    p = load_plan(tiny_plan)
    Executor.from_plan(p, kv_budget_bytes=1 << 20)
    Tokenizer.from_plan(p)
    assert sorted(hashed) == sorted(p.manifest.files)


def test_loading_a_plan_leaves_no_temporary_files(tiny_plan, tmp_path):
    """Loading unpacks the engine into a private directory that is gone once it is loaded,
    even for a process that then dies without cleaning up (torch's own loader left a copy of
    the engine in /tmp on every such exit)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import os, sys; from kiln.runtime.compute import claim_process; claim_process(1)\n"
            "from kiln.runtime.plan import load_plan; from kiln.runtime.executor import Executor\n"
            f"ex = Executor.from_plan(load_plan({str(tiny_plan)!r}), kv_budget_bytes=1 << 20)\n"
            "from pathlib import Path\n"
            "print([str(f) for f in Path(os.environ['TMPDIR']).rglob('*') if f.is_file()])\n"
            "sys.stdout.flush(); os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(tmp)}, cwd=Path(__file__).parents[2],
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"    # no file while the engine is loaded
    assert [f for f in tmp.rglob("*") if f.is_file()] == []            # nor after it died
    assert not [d for d in tmp.iterdir() if d.name.startswith(("aotinductor_", "kiln-plan-"))]


def test_build_leaves_no_compiled_model_in_inductors_cache(tiny_spec_path, tmp_path):
    """The generated model (.cpp, and a .so that embeds the weights) is removed once packaged;
    Inductor's cache used to keep one per build (100-540 MB each for SmolLM2)."""
    cache = tmp_path / "inductor-cache"
    code = ("from kiln.builder.build import build; from kiln.builder.progress import Progress\n"
            f"build({str(tiny_spec_path)!r}, {str(tmp_path / 'plan')!r}, "
            "progress=Progress(enabled=False))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                       cwd=Path(__file__).parents[2], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "plan" / "engine.pt2").is_file()
    left = [f.name for f in cache.rglob("*") if ".wrapper." in f.name or ".kernel." in f.name]
    assert left == []
    assert not [f for f in (tmp_path / "plan").rglob(".aoti-*")]


def test_two_builds_of_one_output_build_it_once(tiny_spec_path, tmp_path):
    """Two `kiln build`s of one output at once (two CI jobs, two test workers): one builds,
    the other waits for it and finds the plan up to date; nothing is left beside the plan."""
    spec = tmp_path / "s.yaml"       # its own name: a fingerprint no other test has built
    spec.write_text(tiny_spec_path.read_text().replace("name: tiny-random", "name: tiny-twice"))
    cmd = [sys.executable, "-m", "kiln.cli", "build", str(spec), "--out", str(tmp_path / "p")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("up to date" in o for o in outs) == [False, True], outs
    assert [p.name for p in tmp_path.iterdir() if p.name != "s.yaml"] == ["p"]
    load_plan(tmp_path / "p")


def test_failed_build_leaves_nothing(tmp_path):
    """A checkpoint that fails mid-build leaves no plan and no temporary directory."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128}))
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: broken\nmodel: {{source: {ckpt}}}\nlimits: {{max_seq_len: 64, "
                    "max_batch_size: 2, max_num_tokens: 16}\n")
    out = tmp_path / "plans" / "broken"
    with pytest.raises(Exception):
        build(spec, out)
    assert not out.exists()
    assert list((tmp_path / "plans").iterdir()) == [] if (tmp_path / "plans").exists() else True


def test_refused_config_setting_leaves_nothing(tmp_path):
    """A config.json setting kiln does not implement stops the build before anything is
    written, and the error names the key, its value and what is supported."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128,
        "hidden_act": "gelu_pytorch_tanh"}))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: refused\nmodel: {{source: {ckpt}}}\nlimits: {{max_seq_len: 64, "
                    "max_batch_size: 2, max_num_tokens: 16}\n")
    out = tmp_path / "plans" / "refused"
    with pytest.raises(Exception, match=r"hidden_act='gelu_pytorch_tanh' is not supported for "
                       r"model_type 'qwen3'; supported: silu"):
        build(spec, out)
    assert not out.exists()
    assert not (tmp_path / "plans").exists() or not list((tmp_path / "plans").iterdir())


def test_bad_spec_exits_2(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel: {source: random}\nlimits: {max_batch: 3}\n")
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "build", str(spec)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "limits.max_batch" in r.stderr and "unknown key" in r.stderr


def build_edited_tiny_spec(tmp_path, old: str, new: str) -> subprocess.CompletedProcess:
    """`kiln build` of the tiny spec with one edit, into tmp_path/p."""
    spec = tmp_path / "s.yaml"
    spec.write_text((ROOT / "model_specs" / "tiny-random.yaml").read_text().replace(old, new))
    return subprocess.run([sys.executable, "-m", "kiln.cli", "build", str(spec),
                           "--out", str(tmp_path / "p")], capture_output=True, text=True)


def test_max_seq_len_beyond_model_context(tmp_path):
    r = build_edited_tiny_spec(tmp_path, "max_seq_len: 256", "max_seq_len: 4096")
    assert r.returncode == 2
    assert "limits.max_seq_len" in r.stderr and "beyond the model's context of 512" in r.stderr


def test_fingerprint_changes_with_every_input(tiny_spec_path):
    spec = load_spec(tiny_spec_path)
    base = fingerprint_inputs(spec, "w" * 64)
    fp = fingerprint(base)
    assert fingerprint(fingerprint_inputs(spec, "w" * 64)) == fp
    text = Path(tiny_spec_path).read_text()
    for old, new in [("max_batch_size: 8", "max_batch_size: 4"), ("seed: 0", "seed: 1"),
                     ("memory: 8MiB", "memory: 16MiB"), ("device: cpu", "device: h100"),
                     ("tokens_per_block: 16", "tokens_per_block: 32")]:
        changed = parse_spec(text.replace(old, new))
        assert fingerprint(fingerprint_inputs(changed, "w" * 64)) != fp, old
    assert fingerprint(fingerprint_inputs(spec, "x" * 64)) != fp            # weights
    other_target = dataclasses.replace(build_target(spec), isa="avx512")
    assert other_target.to_json() == dict(base["target"], isa="avx512")
    assert fingerprint(fingerprint_inputs(spec, "w" * 64, target=other_target)) != fp
    tools = {"kiln": "9.9.9", "torch": torch.__version__, "python": "3.11"}
    assert fingerprint(fingerprint_inputs(spec, "w" * 64, tools=tools)) != fp
    assert fingerprint(fingerprint_inputs(spec, "w" * 64, code="c" * 64)) != fp   # edited code


def test_edited_plan_code_is_not_up_to_date(tiny_spec_path, monkeypatch):
    """The quick key and the fingerprint follow the builder's and plugins' sources: an edited
    kernel or builder rebuilds plans at the same version number (no stale cache)."""
    from kiln.builder import uptodate

    spec = load_spec(tiny_spec_path)
    key, fp = uptodate.quick_key(spec), fingerprint(fingerprint_inputs(spec, "w" * 64))
    monkeypatch.setattr(uptodate, "code_digest", lambda: "e" * 64)
    assert uptodate.quick_key(spec) != key
    assert fingerprint(fingerprint_inputs(spec, "w" * 64)) != fp


def test_cli_inspect(tiny_plan):
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tiny_plan)],
                       capture_output=True, text=True, check=True)
    for word in ("parameters", "precision", "target", "limits", "kv cache", "fingerprint",
                 "toolchain", "size"):
        assert word in r.stdout
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tiny_plan), "--json"],
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["name"] == "tiny-random"


def test_fingerprint_ignores_where_a_local_checkpoint_lives():
    a = parse_spec("name: m\nmodel: {source: /data/a/model.gguf}\n")
    b = parse_spec("name: m\nmodel: {source: /elsewhere/model.gguf}\n")
    assert fingerprint(fingerprint_inputs(a, "w" * 64)) == fingerprint(fingerprint_inputs(b, "w" * 64))
    assert fingerprint(fingerprint_inputs(a, "w" * 64)) != fingerprint(fingerprint_inputs(a, "v" * 64))


def test_gpu_target_without_gpu_is_a_clear_error(tmp_path):
    r = build_edited_tiny_spec(tmp_path, "device: cpu", "device: h100")
    assert r.returncode == 1
    assert "target.device 'h100'" in r.stderr
    assert not (tmp_path / "p").exists()
