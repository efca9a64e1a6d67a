"""Which models kiln builds, at which precision: architecture x source (HF / GGUF) x precision
x KV cache, each cell built from a tiny random model made with transformers' own classes.

A cell is `passed` (built; its accuracy gate passed, and for fp32 plans greedy tokens and
logits equal transformers' on a few prompts), `gate_failed` (the build ran and refused the
plan at its accuracy gate: ppl increase and limit recorded), `refused` (the build refused the
spec or checkpoint: the message recorded), `mismatch` (built, but its tokens or logits differ
from transformers') or `error` (an unexpected exception). Not a test: a tool whose output is
docs/MODELS.md and bench/results/models_matrix.json.

    nice -n 10 python bench/models_matrix.py \
        --json bench/results/models_matrix.json --markdown docs/MODELS.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))            # the tests' tiny-model helpers

import torch  # noqa: E402

from tests.model import test_gemma_plans as gemma_t  # noqa: E402
from tests.model import test_moe_plans as moe_t  # noqa: E402
from tests.model import test_phi3_plans as phi3_t  # noqa: E402
from tests.model import test_sliding_window_plans as window_t  # noqa: E402
from tests.model.test_qwen3_plans import (  # noqa: E402
    PROMPTS, _build, _check_plan_matches_transformers)
from tests.model.test_sources import _hf_model, _write_gguf, _write_tokenizer  # noqa: E402

import transformers  # noqa: E402

CHECK_PROMPTS = 4          # prompts whose greedy tokens an fp32 cell compares


@dataclass(frozen=True)
class Arch:
    """One architecture: its tiny model, its GGUF (None: no GGUF cell) and how to build it."""
    name: str
    make: Callable[[], torch.nn.Module]
    gguf_arch: Optional[str]              # llama.cpp's general.architecture
    prompts: list
    note: str
    max_seq_len: int = 256
    max_num_tokens: int = 64
    # writes the GGUF at the path; returns the transformers model its tokens are checked on
    write_gguf: Optional[Callable[[Path, torch.nn.Module], torch.nn.Module]] = None


@dataclass(frozen=True)
class Precision:
    label: str
    weights: str
    activations: str = "fp32"
    kv_cache: Optional[str] = None        # None: the build's default

    def spec(self) -> dict:
        p = {"weights": self.weights, "activations": self.activations}
        if self.kv_cache:
            p["kv_cache"] = self.kv_cache
        return p


PRECISIONS = [
    Precision("fp32", "fp32", kv_cache="fp32"),
    Precision("fp32 + KV int8", "fp32", kv_cache="int8"),
    Precision("fp32 + KV fp8", "fp32", kv_cache="fp8"),
    Precision("bf16", "bf16"),
    Precision("int8", "int8"),
    Precision("int4", "int4"),
    Precision("W4A8", "int4", activations="int8"),
    Precision("W8A8", "int8", activations="int8"),
    Precision("fp8", "fp8"),
]
GGUF_PRECISIONS = ("fp32", "int8")


@dataclass
class Cell:
    arch: str
    source: str                           # hf | gguf
    precision: str
    backend: str
    spec: dict
    status: str = "error"                 # passed | gate_failed | refused | mismatch | error
    kv_cache: Optional[str] = None        # what the plan records
    ppl_increase: Optional[float] = None
    max_ppl_increase: Optional[float] = None
    top1_agreement: Optional[float] = None
    tokens_match: Optional[bool] = None   # fp32 cells: greedy tokens equal transformers'
    detail: str = ""
    seconds: float = 0.0


# --- the architectures ----------------------------------------------------------------------

def _mistral():
    return window_t._tiny(transformers.MistralConfig, transformers.MistralForCausalLM, seed=5,
                          sliding_window=window_t.WINDOW, tie_word_embeddings=False)


def _gguf_writer(arch: str):
    def write(path, model):
        _write_gguf(path, arch, model)
        return model
    return write


def _gemma_gguf(version: str):
    def write(path, _model):
        twin = gemma_t._gemma(version, gguf_twin=True)   # llama.cpp's GGUF: see its test
        gemma_t._write_gemma_gguf(path, version, twin)
        return twin
    return write


def architectures() -> list[Arch]:
    """The matrix's rows, in README order."""
    lp = phi3_t.LONG_PROMPTS
    return [
        Arch("llama", lambda: _hf_model("llama", dict(tie_word_embeddings=False), seed=1),
             "llama", PROMPTS, "Llama 2/3, SmolLM", write_gguf=_gguf_writer("llama")),
        Arch("mistral", _mistral, "llama", window_t.PROMPTS,
             f"sliding window {window_t.WINDOW} on every layer, prompts up to 2.5 windows",
             max_seq_len=128, write_gguf=_gguf_writer("llama")),
        Arch("qwen2", lambda: _hf_model("qwen2", dict(tie_word_embeddings=False), seed=1),
             "qwen2", PROMPTS, "q/k/v biases", write_gguf=_gguf_writer("qwen2")),
        Arch("qwen3", lambda: _hf_model("qwen3", dict(tie_word_embeddings=False, head_dim=32),
                                        seed=3),
             "qwen3", PROMPTS, "per-head q/k RMSNorm, head_dim 32 != hidden/heads",
             write_gguf=_gguf_writer("qwen3")),
        Arch("gemma2", lambda: gemma_t._gemma("gemma2"), "gemma2", PROMPTS,
             "window 16 on alternate layers, attention and final logit soft-caps",
             write_gguf=_gemma_gguf("gemma2")),
        Arch("gemma3_text", lambda: gemma_t._gemma("gemma3"), "gemma3", PROMPTS,
             "5 local : 1 global layers, q/k norm, two RoPE bases",
             write_gguf=_gemma_gguf("gemma3")),
        Arch("phi3", lambda: _hf_model("phi3", dict(tie_word_embeddings=False, pad_token_id=0,
                                                    sliding_window=phi3_t.WINDOW), seed=5),
             "phi3", PROMPTS, "fused qkv / gate_up, sliding window 16",
             write_gguf=_gguf_writer("phi3")),
        Arch("phi3_longrope", lambda: _hf_model("phi3", phi3_t._longrope_kw(), seed=6),
             "phi3", lp, "LongRoPE (long factors), partial rotary 0.75 (Phi-4-mini)",
             max_num_tokens=128, write_gguf=_gguf_writer("phi3")),
        Arch("mixtral", lambda: moe_t.moe_model("mixtral", seed=5), "llama", PROMPTS,
             "8 experts, top-2", write_gguf=_gguf_writer("llama")),
        Arch("qwen3_moe", lambda: moe_t.moe_model("qwen3_moe", seed=5), "qwen3moe", PROMPTS,
             "16 experts of width 32, top-4 renormalized, one dense layer",
             write_gguf=_gguf_writer("qwen3moe")),
    ]


# --- one cell -------------------------------------------------------------------------------

GATE_RE = re.compile(r"is ([+-][\d.]+)%, above accuracy\.max_ppl_increase ([\d.]+)% "
                     r"\(top-1 agreement ([\d.]+)%")


def _short(msg: str, limit: int = 300) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[:limit - 1] + "…"


def run_cell(work: Path, arch: Arch, source: str, src_path: Path, ref_model,
             prec: Precision, backend: str) -> Cell:
    """Build one plan; gate, refusal or token check recorded, never raised."""
    from kiln.builder.build import BuildError

    name = f"{arch.name}-{source}-{prec.label}-{backend}".replace(" ", "").replace("+", "-")
    cell = Cell(arch.name, source, prec.label, backend, prec.spec())
    t0 = time.perf_counter()
    try:
        plan = _build(work, src_path, name, prec.spec(), backend=backend,
                      max_seq_len=arch.max_seq_len, max_num_tokens=arch.max_num_tokens)
        m = json.loads((plan / "plan.json").read_text())
        cell.kv_cache = m["precision"]["kv_cache"]
        acc = m.get("accuracy")
        if acc:
            cell.ppl_increase, cell.max_ppl_increase = acc["ppl_increase"], acc["max_ppl_increase"]
            cell.top1_agreement = acc["top1_agreement"]
        cell.status = "passed"
        if prec.weights == "fp32" and prec.kv_cache == "fp32":
            try:
                _check_plan_matches_transformers(plan, ref_model, arch.prompts[:CHECK_PROMPTS])
                cell.tokens_match = True
            except AssertionError as e:
                cell.tokens_match, cell.status = False, "mismatch"
                cell.detail = _short(f"differs from transformers: {e}")
    except (BuildError, ValueError) as e:   # SpecError, UnsupportedConfig, FieldError
        g = GATE_RE.search(str(e))
        if g:
            cell.status = "gate_failed"
            cell.ppl_increase, cell.max_ppl_increase = float(g[1]) / 100, float(g[2]) / 100
            cell.top1_agreement = float(g[3]) / 100
        else:
            cell.status = "refused"
        cell.detail = _short(e)
    except Exception as e:   # an unexpected failure: recorded with its type, the run goes on
        cell.status, cell.detail = "error", _short(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    cell.seconds = round(time.perf_counter() - t0, 1)
    return cell


def run_arch(work: Path, arch: Arch, log, aoti: str = "also") -> list[Cell]:
    """Every cell of one architecture: the HF precisions (eager), one aoti fp32 plan (aoti:
    also | no | only), GGUF."""
    d = work / arch.name
    model = arch.make()
    model.save_pretrained(d / "hf")
    _write_tokenizer(d / "hf")
    jobs = [("hf", d / "hf", model, p, "eager") for p in PRECISIONS]
    if aoti != "no":
        jobs.append(("hf", d / "hf", model, PRECISIONS[0], "aoti"))
    if aoti == "only":
        jobs = jobs[-1:]
    elif arch.write_gguf is not None:
        gguf_path = d / f"tiny-{arch.name}.gguf"
        twin = arch.write_gguf(gguf_path, model)
        jobs += [("gguf", gguf_path, twin, p, "eager") for p in PRECISIONS
                 if p.label in GGUF_PRECISIONS]
    cells = []
    for source, path, ref, prec, backend in jobs:
        cell = run_cell(d, arch, source, path, ref, prec, backend)
        log(f"{arch.name:14s} {source:4s} {prec.label:15s} {backend:5s} {cell.status:11s} "
            f"{cell.seconds:6.1f}s {cell.detail[:120]}")
        cells.append(cell)
    return cells


# --- output ---------------------------------------------------------------------------------

def host_description() -> str:
    import platform

    from kiln.plugins import isa

    return (f"{platform.machine()}, ISA level {isa.best_level(isa.cpu_flags()).name}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


SUMMARY = [   # compact column -> the (source, precision) cells it stands for
    ("HF", [("hf", "fp32")]), ("GGUF", [("gguf", "fp32"), ("gguf", "int8")]),
    ("fp32/bf16", [("hf", "fp32"), ("hf", "bf16")]), ("int8", [("hf", "int8")]),
    ("int4", [("hf", "int4")]), ("W4A8", [("hf", "W4A8")]), ("W8A8", [("hf", "W8A8")]),
    ("fp8", [("hf", "fp8")]),
    ("KV int8/fp8", [("hf", "fp32 + KV int8"), ("hf", "fp32 + KV fp8")]),
]
MARK = {"passed": "✓", "gate_failed": "✗ gate", "refused": "✗ refused",
        "mismatch": "✗ tokens", "error": "✗ error"}


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{x:+.2%}" if x < 0 or x > 0 else "+0.00%"


def summary_table(archs: list[Arch], cells: list[Cell]) -> list[str]:
    """One row per architecture: ✓ when every cell a column stands for passed, else ✗ and
    a footnote with the first failing cell's reason."""
    rows = ["| architecture | " + " | ".join(c for c, _ in SUMMARY) + " |",
            "|---" * (len(SUMMARY) + 1) + "|"]
    notes: dict[str, int] = {}
    for arch in archs:
        mine = [c for c in cells if c.arch == arch.name]
        out = []
        for _, keys in SUMMARY:
            hit = [c for c in mine if (c.source, c.precision) in keys]
            if not hit:
                out.append("—")
                continue
            bad = [c for c in hit if c.status != "passed"]
            if not bad:
                out.append("✓")
                continue
            why = f"{bad[0].source} {bad[0].precision}: {bad[0].status}: {bad[0].detail}"
            n = notes.setdefault(why, len(notes) + 1)
            out.append(f"✗[^{n}]")
        rows.append(f"| {arch.name} | " + " | ".join(out) + " |")
    rows.append("")
    rows += [f"[^{n}]: {why}" for why, n in notes.items()]
    return rows


def full_table(cells: list[Cell]) -> list[str]:
    rows = ["| architecture | source | precision | backend | KV | result | ppl increase "
            "(limit) | top-1 | tokens = transformers | s |", "|---" * 10 + "|"]
    for c in cells:
        ppl = "" if c.ppl_increase is None else (
            f"{_pct(c.ppl_increase)} ({c.max_ppl_increase:.0%})")
        top1 = "" if c.top1_agreement is None else f"{c.top1_agreement:.1%}"
        tok = {None: "", True: "yes", False: "**no**"}[c.tokens_match]
        rows.append(f"| {c.arch} | {c.source} | {c.precision} | {c.backend} | "
                    f"{c.kv_cache or ''} | {MARK[c.status]} | {ppl} | {top1} | {tok} | "
                    f"{c.seconds:.0f} |")
    return rows


def markdown(archs: list[Arch], cells: list[Cell], host: str) -> str:
    """docs/MODELS.md: what builds and passes, at which precision, from which source."""
    lines = [
        "# Models: architectures, sources and precisions", "",
        "Each architecture below is a tiny random model made with transformers' own classes "
        "(config, random init, `save_pretrained`), and its GGUF written with the `gguf` "
        "package's writer as llama.cpp's converter names the tensors. Every cell is a "
        "`kiln build` of it: **✓** the plan was built and passed its accuracy gate "
        "(perplexity increase on the evaluation text against the eager fp32 model, within "
        "the limit); fp32 cells also give transformers' greedy tokens, and logits within "
        "1e-3, on a few prompts (longer than the sliding window where the model has one). "
        "**✗** says why not: a build refused (its message), a gate failed (the numbers), "
        "or tokens that differ.", "",
        "Precisions: weights fp32, bf16, int8 (per row), int4 (per group), fp8 (e4m3, per "
        "row); W8A8 and W4A8 also quantize activations to int8 at run time. fp32 plans run "
        "with an fp32, int8 or fp8 KV cache; the others with their default (bf16). Matrix "
        "plans use the eager backend; one fp32 plan per architecture is also built with "
        "AOTInductor (`aoti`). fp32 plans with an fp32 KV cache have no accuracy gate "
        "(they compute what the reference does); their check is transformers' tokens.", "",
        "A random model's perplexity on real text is close to its vocabulary size, so its "
        "perplexity increase is small at any precision; top-1 agreement with the fp32 model "
        "shows more. These cells show that each combination builds, runs and is gated; "
        "the accuracy of real checkpoints is in "
        "[PERFORMANCE.md](PERFORMANCE.md#precisions-accuracy-and-size).", "",
        f"Measured on: {host}.", "",
        "Regenerate (about an hour on two shared cores; `--archs` picks a subset, "
        "`--aoti no|only` skips or isolates the AOTInductor plans, and `--from-json` merges "
        "runs made in parallel):", "", "```", COMMAND, "```", "",
        "| architecture | GGUF `general.architecture` | what the tiny model exercises |",
        "|---|---|---|",
        *[f"| {a.name} | {a.gguf_arch or '—'} | {a.note} |" for a in archs], "",
        "## Summary", "", *summary_table(archs, cells), "",
        "## Every cell", "", *full_table(cells), "",
    ]
    notes = [c for c in cells if c.status != "passed"]
    if notes:
        lines += ["## Why not", ""]
        lines += [f"- {c.arch}, {c.source}, {c.precision} ({c.backend}): {c.detail}"
                  for c in notes]
        lines.append("")
    return "\n".join(lines)


COMMAND = ("nice -n 10 python bench/models_matrix.py --json bench/results/models_matrix.json "
           "--markdown docs/MODELS.md")


def write_outputs(args, archs: list[Arch], cells: list[Cell]) -> None:
    """The JSON and markdown of the cells so far."""
    host = host_description()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host, "command": COMMAND,
                                         "archs": {a.name: a.note for a in archs},
                                         "cells": [dataclasses.asdict(c) for c in cells]},
                                        indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(archs, cells, host))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [a.name for a in architectures()]
    ap.add_argument("--archs", default=",".join(names),
                    help=f"comma-separated subset of {','.join(names)}")
    ap.add_argument("--json", type=Path, help="write every cell as JSON here")
    ap.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    ap.add_argument("--aoti", choices=("also", "no", "only"), default="also",
                    help="the one AOTInductor fp32 plan per architecture (minutes each): "
                    "also build it (default), skip it, or build only it")
    ap.add_argument("--from-json", type=Path, nargs="+", metavar="JSON",
                    help="build nothing: merge these runs' JSON into --json / --markdown")
    ap.add_argument("--workdir", type=Path, help="keep models and plans here (default: temp)")
    args = ap.parse_args(argv)
    chosen = args.archs.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        ap.error(f"--archs: unknown {unknown}; known: {names}")
    archs = [a for a in architectures() if a.name in chosen]
    if args.from_json:
        runs = [json.loads(p.read_text()) for p in args.from_json]
        order = {a.name: i for i, a in enumerate(architectures())}
        cells = sorted((Cell(**c) for r in runs for c in r["cells"]),
                       key=lambda c: order[c.arch])   # stable: each run's order kept
        done = {c.arch for c in cells}
        write_outputs(args, [a for a in architectures() if a.name in done], cells)
        return 0
    with tempfile.TemporaryDirectory(prefix="kiln-matrix-") as tmp:
        work = args.workdir or Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(work / "cache")   # digests, accuracy references
        cells: list[Cell] = []
        for i, arch in enumerate(archs):   # results written after each architecture
            cells += run_arch(work, arch, lambda s: print(s, flush=True), args.aoti)
            write_outputs(args, archs[:i + 1], cells)
    bad = [c for c in cells if c.status in ("mismatch", "error")]
    print(f"{len(cells)} cells: " + ", ".join(
        f"{s} {sum(c.status == s for c in cells)}"
        for s in ("passed", "gate_failed", "refused", "mismatch", "error")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
