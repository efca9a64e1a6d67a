"""One tiny int8 plan per CPU ISA level this host runs (none and avx2 at least, AVX-512 levels
where present): each records its level's features, contains no instruction of a higher level,
names its kernels' vector paths, and computes the same logits and greedy tokens as the others.

Each plan is built and run in its own process (`kiln build`, then a small script): the kernel
libraries of two levels register the same ops and must not share a process.
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kiln.plugins import isa
from tests.conftest import TEST_PLANS
from tests.model.test_quant_plans import tiny_spec, write_spec

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")]

ROOT = Path(__file__).resolve().parents[2]
HOST = isa.host_level()
LEVELS = [n for n in isa.LEVEL_NAMES
          if isa.LEVEL_NAMES.index(n) <= isa.LEVEL_NAMES.index(HOST.name)]

RUN = r"""
import json, sys, torch
torch.set_num_threads(1)
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import load_plan
ex = Executor.from_plan(load_plan(sys.argv[1]))
g = torch.Generator().manual_seed(1)
tables, lens, starts = [[5, 2, 9], [1, 7, 3]], [20, 7], [0, 0]
logits = []
for _ in range(2):
    toks = [torch.randint(0, 384, (n,), generator=g).tolist() for n in lens]
    logits.append(ex.execute(ModelInput.build(toks, starts, tables, 16)))
    starts = [s + n for s, n in zip(starts, lens)]
    lens = [1, 1]
# greedy: 12 tokens of one sequence, fed back one step at a time
seq, table, pos = [3, 17, 42, 7], [11, 12], 0
out = []
for _ in range(12):
    row = ex.execute(ModelInput.build([seq[pos:]], [pos], [table], 16))[0]
    pos = len(seq)
    seq.append(int(row.argmax()))
    out.append(seq[-1])
torch.save({"logits": torch.cat(logits), "greedy": out}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def isa_plans(tmp_path_factory) -> dict[str, Path]:
    """The plans, built two at a time: a build is half single-threaded (export, Inductor's
    lowering, one compiler process), and each level compiles its own kernel libraries."""
    specs = tmp_path_factory.mktemp("isa-specs")

    def build(level: str) -> Path:
        data = tiny_spec(f"tiny-int8-{level}", {"weights": "int8", "keep_high_precision": []})
        data["target"]["isa"] = level
        out = TEST_PLANS / f"tiny-int8-isa-{level}"
        r = subprocess.run([sys.executable, "-m", "kiln.cli", "build",
                            str(write_spec(specs, data)), "--out", str(out)],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, f"{level}: {r.stderr[-3000:]}"
        return out

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(LEVELS, pool.map(build, LEVELS)))


@pytest.fixture(scope="module")
def isa_outputs(isa_plans, tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("isa-out")
    outs = {}
    for level, plan in isa_plans.items():
        r = subprocess.run([sys.executable, "-c", RUN, str(plan), str(d / f"{level}.pt")],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, f"{level}: {r.stderr[-3000:]}"
        outs[level] = torch.load(d / f"{level}.pt")
    return outs


def test_every_level_runs_here_and_records_its_features(isa_plans):
    assert {"none", "avx2"} <= set(isa_plans)
    for level, plan in isa_plans.items():
        m = json.loads((plan / "plan.json").read_text())
        t = m["target"]
        assert t["isa"] == level and m["spec"]["target"]["isa"] == level
        assert t["cpu_features"] == isa.compiler_features(isa.LEVELS[level].flags)
        paths = m["engine"]["kernel_paths"]
        assert set(paths) == set(m["engine"]["kernels"]) and len(paths) == 3
        for lib, path in paths.items():   # a vector level never ships a scalar kernel
            if lib.endswith("kiln_engine_call.so"):    # how the engine is called: no vectors
                assert path.startswith("engine call"), (level, lib, path)
                continue
            assert ("scalar" in path) == (level == "none"), (level, lib, path)
        r = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(plan)],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        assert f"x86_64, {level})" in r.stdout and "kernel" in r.stdout
        if level != "none":
            assert "cpu features" in r.stdout and "avx2" in r.stdout


def test_levels_compute_the_same_tokens(isa_outputs):
    ref = isa_outputs[HOST.name]
    for level, out in isa_outputs.items():
        diff = (out["logits"] - ref["logits"]).abs().max().item()
        assert diff < 1e-3, f"{level} vs {HOST.name}: max logit difference {diff}"
        assert torch.equal(out["logits"].argmax(-1), ref["logits"].argmax(-1)), level
        assert out["greedy"] == ref["greedy"], level


def _disassembly(so_bytes: bytes, tmp: Path) -> str:
    f = tmp / "lib.so"
    f.write_bytes(so_bytes)
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(f)], capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
@pytest.mark.parametrize("level", ["none", "avx2"])
def test_lower_level_code_has_no_higher_instructions(isa_plans, level, tmp_path):
    """Nothing in an avx2 (or scalar) plan, engine or kernels, touches AVX-512 registers: the
    compiler's default -march=native is not in the way (it was, before plans pinned a level)."""
    plan = isa_plans[level]
    libs = [p.read_bytes() for p in (plan / "kernels").glob("*.so")]
    with zipfile.ZipFile(plan / "engine.pt2") as z:
        libs += [z.read(n) for n in z.namelist() if n.endswith(".so")]
    assert len(libs) >= 3
    for so in libs:
        asm = _disassembly(so, tmp_path)
        assert "%zmm" not in asm and "%k1" not in asm, f"{level} plan has AVX-512 code"
        if level == "none":   # no AVX at all in Kiln's and Inductor's own code
            assert "%ymm" not in asm, "scalar plan has AVX code"


KERNELS = r"""
import sys, torch
from kiln.plugins import isa
from kiln.plugins.quant import formats, kernels, ops
from kiln.plugins.cpp_build import kernel_path
from tests.helpers import reference_input, rows16_digits_bound
lib = kernels.build(isa.LEVELS[sys.argv[1]])
kernels.load(lib)
print(kernel_path(lib))
g = torch.Generator().manual_seed(0)


def alone(x, q, b):   # each row of x through the W8A8 / W4A8 op by itself
    return torch.cat([ops.quant_linear(x[i:i + 1], q, b, activations="int8")
                      for i in range(x.shape[0])])


# W8A8 and W4A8 re-quantize every layer's output, so an ulp of difference compounds over the
# layers: a row's result must be bit for bit the one it gets alone, on every path (AMX tiles
# from 4 / 32 rows, VNNI tiles of 1-4 rows).
# (17, 48, 128), (40, 96, 576): the amx level's tiles (the batched int8 GEMM, W4A8 from 32
# rows and int4_rows16 from 16: whole tiles of 16, the rest on VNNI) with tails of x rows
# and weight rows; (36, 32, 96): an odd number of W4A8 groups; K = 200 and 96 are not whole
# int8 tiles (_int_mm); the VNNI levels' GEMM (from 8 rows): (17, 48, 128) and (40, 96, 576)
# end on a half block of x rows, (12, 50, 192) on two weight rows past its 16-row blocks
for m, n, k in [(1, 960, 576), (5, 576, 1536), (33, 130, 200), (2, 37, 100), (7, 48, 96),
                (17, 48, 128), (40, 96, 576), (36, 32, 96), (12, 50, 192)]:
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    qw = formats.quantize(w, "int8")
    out = ops.quant_linear(x, qw, b, activations="int8")
    ref = ops.linear_int8_a8_reference(x, qw.qweight, qw.scales, b)
    assert (out - ref).abs().max() <= 1e-6 * ref.abs().max(), ("w8a8", m, n, k)
    assert torch.equal(out, alone(x, qw, b)), ("w8a8 batch invariance", m, n, k)
    if k % 32 == 0:
        for scheme in ("int8", "int4", "fp8", "bf16", "fp32"):
            q = formats.quantize(w, scheme, 32 if scheme == "int4" else None)
            args = (q.qweight, q.scales, q.zeros, 32) if scheme == "int4" else (q.qweight, q.scales)
            ref = ops.REFERENCES[scheme](reference_input(x, w, scheme, lib), *args, b)
            out = ops.quant_linear(x, q, b)
            assert (out - ref).abs().max() <= 2e-5 * ref.abs().max(), (scheme, m, n, k)
    for scheme in ("int8", "fp8", "bf16", "fp32"):   # one row of x: weight rows in groups
        for kk in (k, k - 3):                           # and one at a time, K's tail
            x1, q = x[:1, :kk].contiguous(), formats.quantize(w[:, :kk].contiguous(), scheme)
            ref = ops.REFERENCES[scheme](x1, q.qweight, q.scales, b)
            out = ops.quant_linear(x1, q, b)
            assert (out - ref).abs().max() <= 2e-5 * ref.abs().max(), (scheme, 1, n, kk)
    if k % 32 == 0 and n % 16 == 0:   # W4A8 and int4_rows16: tiles of 1-4 rows of x, every group
        q = formats.quantize(w, "int4_a8")
        for rows in (x, x[:1], torch.zeros_like(x)):
            out = ops.quant_linear(rows, q, b, activations="int8")
            ref = ops.linear_int4_a8_reference(rows, q.qweight, q.scales, q.zeros, b)
            assert (out - ref).abs().max() <= 2e-5 * ref.abs().max(), ("w4a8", m, n, k)
            assert torch.equal(out, alone(rows, q, b)), ("w4a8 batch invariance", m, n, k)
            out = ops.quant_linear(rows, q, b)   # x as two int8 digits: their own bound
            ref = ops.linear_int4_rows16_reference(rows, q.qweight, q.scales, q.zeros, b)
            excess = ((out - ref).abs().double() - rows16_digits_bound(rows, q)
                      - 2e-5 * ref.abs().max())
            assert (excess <= 0).all(), ("rows16", m, n, k)
            assert torch.equal(out, torch.cat([ops.quant_linear(rows[i:i + 1], q, b)
                                               for i in range(m)])), ("rows16 invariance", m, n, k)
print("ok")
"""


@pytest.mark.parametrize("level", LEVELS)
def test_quant_kernels_match_references_at_every_level(level):
    """Each level's compiled kernels (the W8A8 VNNI / maddubs / scalar paths, the weight-only
    decoders) give the references' results; each in its own process."""
    r = subprocess.run([sys.executable, "-c", KERNELS, level], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    path = r.stdout.splitlines()[0]
    want = {"none": "w8a8: scalar", "avx2": "w8a8: avx2", "avx512": "w8a8: avx2"}.get(
        level, "w8a8: avx512-vnni")
    assert want in path and want.replace("w8a8", "w4a8") in path, path
    assert ("amx tiles" in path) == (level == "amx"), path   # AMX code at that level only
    assert ("amx-bf16 tiles" in path) == (level == "amx"), path
    assert ("bf16 from 8 rows" in path) == (level in ("avx512_bf16", "amx")), path


ATTENTION = r"""
import sys, torch
from kiln.plugins import isa
from kiln.plugins.cpp_build import kernel_path
from kiln.plugins.paged_kv import kernels
from tests.helpers import MIXED, check_paged_attention, make_batch
lib = kernels.build(isa.LEVELS[sys.argv[1]])
kernels.load(lib)
print(kernel_path(lib))
op = torch.ops.kiln.paged_attention
seqs = [MIXED, [(300, 1)] * 3, [(40, 2), (17, 1)]]
for cache in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
    for H, KVH, D, bs in [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 16), (8, 2, 16, 8),
                          (6, 2, 36, 8)]:
        for i, s in enumerate(seqs):
            tol = 1e-4 if cache == torch.float32 else 2e-3
            for threads in (1, 2):
                torch.set_num_threads(threads)
                check_paged_attention(op, make_batch(s, H, KVH, D, bs, cache_dtype=cache,
                                                     seed=D + bs + i), tol, tol)
    for H, KVH, D, bs in [(9, 3, 64, 16), (6, 2, 36, 8)]:   # a window and a soft-cap
        for s, window, cap in [(MIXED, 33, 2.0), ([(300, 1)] * 3, 100, 0.0)]:
            b = make_batch(s, H, KVH, D, bs, cache_dtype=cache, seed=window)
            b.window, b.softcap = window, cap
            tol = 1e-4 if cache == torch.float32 else 2e-3
            check_paged_attention(op, b, tol, tol)
print("ok")
"""


@pytest.mark.parametrize("level", LEVELS)
def test_paged_attention_matches_the_reference_at_every_level(level):
    """Each level's attention kernel (at::vec width, the pool rows' conversions, the decode
    blocks' register paths for head dims of 2, 4 and 8 vectors and the other dims' float rows,
    with and without a window and a soft-cap) gives the reference's output for every pool
    dtype; each in its own process."""
    r = subprocess.run([sys.executable, "-c", ATTENTION, level], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
