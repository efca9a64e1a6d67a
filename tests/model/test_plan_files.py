"""Every file the runtime reads from a plan is listed in its manifest, inside the plan
directory, checked against its sha256 and read once; `--expect-digest` pins a plan's bytes."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime.plan import PlanError, load_plan, read_manifest
from kiln.runtime.tokenizer import Tokenizer
from tests.server_helpers import ROOT, free_port

pytestmark = pytest.mark.model

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
OTHER_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


def plan_copy(tiny_plan: Path, dst: Path, unlist: tuple[str, ...] = ()) -> Path:
    """A copy of the tiny plan whose manifest no longer lists the files in `unlist`."""
    shutil.copytree(tiny_plan, dst)
    if unlist:
        m = json.loads((dst / "plan.json").read_text())
        for rel in unlist:
            m["files"].pop(rel)
        (dst / "plan.json").write_text(json.dumps(m))
    return dst


def with_template(gen_bytes: bytes, template: str) -> bytes:
    return json.dumps({**json.loads(gen_bytes), "chat_template": template}).encode()


def rewrite_listed(plan: Path, rel: str, data: bytes) -> None:
    """Replace a file of the plan and its manifest entry (as a build would have written it)."""
    (plan / rel).write_bytes(data)
    m = json.loads((plan / "plan.json").read_text())
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (plan / "plan.json").write_text(json.dumps(m))


@pytest.mark.parametrize("rel", ["tokenizer.json", "generation.json"])
def test_an_unlisted_data_file_is_refused(tiny_plan, tmp_path, rel):
    """A data file the manifest does not checksum is refused, whether it was changed after
    the build or is a link out of the plan (it used to be read as found)."""
    changed = plan_copy(tiny_plan, tmp_path / "changed", unlist=(rel,))
    if rel == "generation.json":
        (changed / rel).write_bytes(with_template((changed / rel).read_bytes(), TEMPLATE))
    else:
        (changed / rel).write_text((changed / rel).read_text().replace('"<s>"', '"<S>"', 1))
    linked = plan_copy(tiny_plan, tmp_path / "linked", unlist=(rel,))
    outside = tmp_path / f"outside-{rel}"
    shutil.copy(linked / rel, outside)
    (linked / rel).unlink()
    (linked / rel).symlink_to(outside)
    for plan in (changed, linked):
        with pytest.raises(PlanError, match=f"refused: {rel} is not among the files its "
                                            "manifest checksums"):
            Tokenizer.from_plan(load_plan(plan))


def test_a_listed_data_file_behind_a_link_is_refused(tiny_plan, tmp_path):
    """A listed file is read without following a link: out of the plan or not."""
    inside = plan_copy(tiny_plan, tmp_path / "inside")
    (inside / "tokenizer.json").rename(inside / "tok.json")
    (inside / "tokenizer.json").symlink_to("tok.json")
    with pytest.raises(PlanError, match="tokenizer.json is a symbolic link"):
        load_plan(inside)
    out = plan_copy(tiny_plan, tmp_path / "out")
    shutil.copy(out / "generation.json", tmp_path / "gen.json")
    (out / "generation.json").unlink()
    (out / "generation.json").symlink_to(tmp_path / "gen.json")
    with pytest.raises(PlanError, match="not a path inside the plan directory"):
        load_plan(out)


def test_data_files_are_read_once_from_the_verified_bytes(tiny_plan, tmp_path):
    """Files swapped after load_plan checked them change nothing: the tokenizer and its chat
    template come from the bytes that were hashed, not from the files again."""
    plan_dir = plan_copy(tiny_plan, tmp_path / "plan")
    gen = plan_dir / "generation.json"
    rewrite_listed(plan_dir, "generation.json", with_template(gen.read_bytes(), TEMPLATE))
    plan = load_plan(plan_dir)
    before = Tokenizer.from_plan(plan)
    (plan_dir / "tokenizer.json").write_text("not a tokenizer")
    gen.write_bytes(with_template(gen.read_bytes(), OTHER_TEMPLATE))
    tok = Tokenizer.from_plan(plan)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    assert tok.encode("hello world") == before.encode("hello world")
    with pytest.raises(PlanError, match="does not match its sha256"):   # a fresh load sees it
        load_plan(plan_dir)


def test_expect_digest_pins_the_plan_bytes(tiny_plan, tmp_path):
    """The digest is the sha256 of plan.json; any other plan is refused, by load_plan and by
    `kiln serve --expect-digest` (one line naming both digests, exit 2, before loading)."""
    digest = hashlib.sha256((tiny_plan / "plan.json").read_bytes()).hexdigest()
    assert load_plan(tiny_plan, expect_digest=digest).digest == digest
    assert read_manifest(tiny_plan, digest.upper()).name == "tiny-random"
    other = plan_copy(tiny_plan, tmp_path / "other")
    m = json.loads((other / "plan.json").read_text())
    m["created_at"] = "2000-01-01T00:00:00Z"      # the same plan, built another time
    (other / "plan.json").write_text(json.dumps(m))
    other_digest = load_plan(other).digest
    with pytest.raises(PlanError, match=f"has digest {other_digest}, not the expected {digest}"):
        load_plan(other, expect_digest=digest)
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(other), "--host", "127.0.0.1",
           "--port", str(free_port()), "--metrics-port", str(free_port()),
           "--expect-digest", digest]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "loading plan" not in r.stderr, r.stderr
    assert lines[-1].startswith("error: ") and other_digest in lines[-1] and digest in lines[-1]


# ---- the weights file: mapped, hashed while mapped, shared by every load --------------------

def _step_logits(step, plan) -> "torch.Tensor":
    """The logits of one 5-token prefill through a loaded step (fresh KV pools)."""
    import torch

    from kiln.plugins.paged_kv import kv_format
    from kiln.runtime.executor import ModelInput

    shape = plan.shape
    bs = plan.manifest.kv_cache.tokens_per_block
    pools = kv_format.new_pools(plan.manifest.kv_cache.dtype, shape.num_layers, 8, bs,
                                shape.num_kv_heads, shape.head_dim)
    inp = ModelInput.build([[1, 5, 9, 2, 7]], [0], [[0, 1]], bs)
    with torch.no_grad():
        return step(*inp.args(), *pools)


def _weights_mappings(plan_dir: Path) -> list[dict]:
    """This process's mappings of the plan's weights file, with smaps' counters (kB) and the
    file's device:inode."""
    target = str((plan_dir / "weights.bin").resolve())
    found, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            cur = {"inode": (head[3], head[4])} if line.endswith(" " + target) else None
            if cur is not None:
                found.append(cur)
        elif cur is not None and len(head) == 3 and head[2] == "kB":
            cur[head[0].rstrip(":")] = int(head[1])
    return found


def test_the_weights_are_mapped_and_shared_by_every_load(tiny_plan, tmp_path):
    """Two loads of a plan map its weights file twice: file-backed, read-only pages of the
    page cache, none copied into the process (no anonymous or dirty page in the mappings); the
    engine computes from those pages themselves (a byte changed in the file after the load is
    what the next step reads)."""
    import mmap

    from kiln.runtime.plan import load_step_fn

    plan_dir = plan_copy(tiny_plan, tmp_path / "plan")
    plan = load_plan(plan_dir)
    steps = [load_step_fn(plan) for _ in range(2)]
    ref = _step_logits(steps[0], plan)
    assert (ref == _step_logits(steps[1], plan)).all()
    maps = _weights_mappings(plan_dir)
    assert len(maps) == 2 and maps[0]["inode"] == maps[1]["inode"]
    for m in maps:   # the page cache's pages (none private), each mapping reads every page
        assert m["Anonymous"] == 0 and m["Private_Dirty"] == 0, m
        assert m["Rss"] == m["Size"], m
    wo = plan.manifest.engine.weights.tensors["layers.0.attention.wo.qweight"]
    with open(plan_dir / "weights.bin", "r+b") as f, mmap.mmap(f.fileno(), 0) as w:
        nbytes = 4 * wo.shape[0] * wo.stride[0]                 # fp32, contiguous rows
        w[wo.offset:wo.offset + nbytes] = bytes(nbytes)
    assert all(not (_step_logits(s, plan) == ref).all() for s in steps)
    del steps
    import gc

    gc.collect()
    assert _weights_mappings(plan_dir) == []      # closing the engines unmapped the file


def test_a_changed_weights_file_is_refused(tiny_plan, tmp_path):
    """The weights are hashed as they are mapped: a changed byte, a file of another size, a
    link, or an index entry outside the file is refused before the engine runs."""
    from kiln.runtime.plan import load_step_fn

    flipped = plan_copy(tiny_plan, tmp_path / "flipped")
    data = bytearray((flipped / "weights.bin").read_bytes())
    data[len(data) // 2] ^= 1
    (flipped / "weights.bin").write_bytes(bytes(data))
    plan = load_plan(flipped)            # the size is right; the bytes are hashed when mapped
    with pytest.raises(PlanError, match="weights.bin does not match its sha256"):
        load_step_fn(plan)
    longer = plan_copy(tiny_plan, tmp_path / "longer")
    with open(longer / "weights.bin", "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(PlanError, match="weights.bin is .* bytes, the manifest says"):
        load_plan(longer)
    linked = plan_copy(tiny_plan, tmp_path / "linked")
    (linked / "weights.bin").rename(linked / "w.bin")
    (linked / "weights.bin").symlink_to("w.bin")
    with pytest.raises(PlanError, match="weights.bin is a symbolic link"):
        load_step_fn(load_plan(linked))
    outside = plan_copy(tiny_plan, tmp_path / "outside")
    m = json.loads((outside / "plan.json").read_text())
    name = next(iter(m["engine"]["weights"]["tensors"]))
    m["engine"]["weights"]["tensors"][name]["offset"] = m["files"]["weights.bin"]["size"]
    (outside / "plan.json").write_text(json.dumps(m))
    with pytest.raises(PlanError, match=f"{name} .* is not a float32 range of the file"):
        load_step_fn(load_plan(outside))
