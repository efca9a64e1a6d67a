"""What Inductor's own int8 GEMM gives against the quant plugin's kernels,
on SmolLM2's shapes, side by side in one process (weights in cache; kernel speed).

    pip install --no-deps torchao==0.18.0     # optional: not a Kiln dependency
    python bench/inductor_gemm.py [--threads 2] [--rows 1 4 32 128]

Per shape and rows of x:
- kiln W8A8 (`kiln::linear_int8_a8`: own VNNI/AVX2 GEMV below 4 rows, oneDNN's `_int_mm` from
  4) and kiln W4A8 (`kiln::linear_int4_a8`), eager calls of the ops a plan runs;
- torchao's `Int8DynamicActivationInt8WeightConfig` (per-token int8 activations, int8
  weights) in two Inductor lowerings:
  * AOTI: `torch.export` + `aoti_compile_and_package(freezing, max_autotune, CPP GEMM
    templates)`, which is how a Kiln plan is compiled; less the call cost of an AOTI package
    that only adds 1 to x (measured here too). As exported, the graph runs `aten._int_mm`
    (oneDNN); "AOTI, matched": the same with export's `_assert_tensor_metadata` nodes removed,
    so that Inductor's int8 GEMM pattern matches and autotunes its CPP template;
  * compile: `torch.compile` with the same settings, where Inductor's x86 pattern matching
    turns the subclass's linear into `qlinear` and autotunes its CPP GEMM template (AMX or
    VNNI micro-kernels, chosen for this CPU) against oneDNN; less the call cost of a compiled
    x + 1.
Best of 7 repetitions each.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.linear_kernels import best_us             # noqa: E402
from kiln.plugins.quant import formats, kernels, ops   # noqa: E402

SHAPES = [(3072, 576), (576, 1536)]   # w13, w2 (out x in)
SETTINGS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def aoti(mod: torch.nn.Module, x: torch.Tensor, where: Path, name: str,
         strip_asserts: bool = False):
    """An AOTInductor package of mod, compiled under SETTINGS. strip_asserts: drop the
    `aten._assert_tensor_metadata` nodes torch.export puts after `_int_mm` and the casts;
    they sit between the ops of Inductor's int8 GEMM pattern and keep it from matching."""
    ep = torch.export.export(mod, (x,))
    if strip_asserts:
        ep = ep.run_decompositions({})
        graph = ep.graph_module.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(node)
        ep.graph_module.recompile()
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(where / f"{name}.pt2"), inductor_configs=SETTINGS)
    return torch._inductor.aoti_load_package(path)


def compiled(mod: torch.nn.Module, x: torch.Tensor):
    """torch.compile(mod), compiled (on its first call) under SETTINGS."""
    import torch._inductor.config as ic
    f = torch.compile(mod)
    with ic.patch(SETTINGS):
        f(x)
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    args = ap.parse_args()
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        from torchao.utils import unwrap_tensor_subclass
    except ImportError:
        sys.exit("torchao is not installed: pip install --no-deps torchao==0.18.0")
    kernels.load()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s), weights in cache, best of 7; microseconds a call "
          "(Inductor columns less the call cost of an x + 1 module built the same way)")
    print(f"{'shape':>10} {'rows':>5} {'kiln W8A8':>10} {'kiln W4A8':>10} "
          f"{'torchao AOTI':>13} {'AOTI, matched':>15} {'torchao compile':>16}")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g)
            q8, q4 = formats.quantize(w, "int8"), formats.quantize(w, "int4_a8")
            for m in args.rows:
                x = torch.randn(m, k, generator=g)
                reps = max(5, 1000 // m)
                a = best_us(lambda: ops.quant_linear(x, q8, None, activations="int8"), reps)
                b = best_us(lambda: ops.quant_linear(x, q4, None, activations="int8"), reps)
                lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).eval()
                lin[0].weight.copy_(w)
                quantize_(lin, Int8DynamicActivationInt8WeightConfig())
                torch._dynamo.reset()
                c_lin, c_one = compiled(lin, x), compiled(AddOne(), x)
                c = best_us(lambda: c_lin(x), reps) - best_us(lambda: c_one(x), reps)
                unwrap_tensor_subclass(lin)
                p_lin = aoti(lin, x, Path(tmp), f"lin{n}_{k}_{m}")
                p_one = aoti(AddOne(), x, Path(tmp), f"one{k}_{m}")
                one = best_us(lambda: p_one(x), reps)
                d = best_us(lambda: p_lin(x), reps) - one
                p_pat = aoti(lin, x, Path(tmp), f"pat{n}_{k}_{m}", strip_asserts=True)
                e = best_us(lambda: p_pat(x), reps) - one
                print(f"{n:>5}x{k:<4} {m:>5} {a:10.1f} {b:10.1f} {d:13.1f} {e:15.1f} {c:16.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
