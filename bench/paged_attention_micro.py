"""Microbenchmark of kiln::paged_attention on CPU: compiled kernel vs pure-torch reference.

SmolLM2-135M attention shapes (H=9, KVH=3, D=64, 16 tokens per block), one layer:
decode at batch 1 and 32 with 512 tokens of context, and one 512-token prefill chunk; then
the kernel's decode on a 2048-token context, global vs a sliding window of --window tokens.

    python bench/paged_attention_micro.py [--threads N] [--iters N] [--window N] [--kv int8]
    python bench/paged_attention_micro.py --layers 30 --kv int8 --threads 2 [--heads 32,8,128]

With --layers L, the decode cases instead run over L layers of their own pools (a whole
decode step's attention, its KV read from memory as in a plan, not from cache), ms per pass.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from kiln.plugins.paged_kv import kernels, kv_format
from kiln.plugins.paged_kv.ops import paged_attention_reference

H, KVH, D, BS = 9, 3, 64, 16


def make_inputs(seqs, dtype=torch.float32, max_seq_len=2048, seed=0, kv="fp32"):
    """seqs: [(tokens already in the pool, tokens this step)] -> the op's arguments (pools of
    `kv`: fp32, bf16, or int8 / fp8 codes + a scale per row)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = math.ceil(max_seq_len / BS)
    need = [math.ceil((c + n) / BS) for c, n in seqs]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    slots, qsl, off = [], [0], 0
    for b, ((ctx, n), nb) in enumerate(zip(seqs, need)):
        bt[b, :nb] = perm[off:off + nb]
        off += nb
        slots += [int(bt[b, p // BS]) * BS + p % BS for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    return (torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, KVH, D, generator=g).to(dtype),
            torch.randn(T, KVH, D, generator=g).to(dtype),
            pool(torch.randn(num_blocks, BS, KVH, D, generator=g), kv),
            pool(torch.randn(num_blocks, BS, KVH, D, generator=g), kv),
            torch.tensor(slots), bt, torch.tensor([c + n for c, n in seqs]), torch.tensor(qsl),
            1.0 / math.sqrt(D))


def pool(x, kv):
    return kv_format.encode(x, kv_format.storage_dtype(kv))


def timeit(fn, args, iters):
    """Best of `iters` calls, in seconds (the machine is shared: the minimum is the stable one)."""
    for _ in range(3):
        fn(*args)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--window", type=int, default=256, help="sliding window of the last cases")
    ap.add_argument("--kv", default="fp32", choices=sorted(kv_format.ELEMENT_BYTES),
                    help="the pools' dtype (int8 / fp8: codes and a scale per row)")
    ap.add_argument("--layers", type=int, default=1,
                    help="> 1: the decode cases over this many layers' pools (see above)")
    ap.add_argument("--heads", default=None, metavar="H,KVH,D",
                    help="another model's heads, e.g. 32,8,128 (Llama 3 8B), 8,4,256 (Gemma 2)")
    a = ap.parse_args()
    if a.heads:
        global H, KVH, D
        H, KVH, D = (int(v) for v in a.heads.split(","))
    torch.set_num_threads(a.threads)
    kernels.load()
    if a.layers > 1:
        return step_cases(a.layers, a.iters, a.kv)
    cases = {"decode b=1 ctx=512": [(511, 1)], "decode b=32 ctx=192": [(191, 1)] * 32,
             "decode b=32 ctx=512": [(511, 1)] * 32, "prefill chunk 512": [(0, 512)]}
    print(f"threads={a.threads}  H={H} KVH={KVH} D={D} block={BS}  (one layer, fp32 q, "
          f"{a.kv} pools, best of N)")
    print(f"{'case':<22}{'kernel ms':>11}{'reference ms':>14}{'speedup':>9}")
    for name, seqs in cases.items():
        args = make_inputs(seqs, kv=a.kv)
        tk = timeit(torch.ops.kiln.paged_attention, args, a.iters)
        tr = timeit(paged_attention_reference, args, max(3, a.iters // 4))
        print(f"{name:<22}{tk * 1e3:>11.3f}{tr * 1e3:>14.3f}{tr / tk:>8.1f}x")
    window_cases(a.window, a.iters, a.kv)


def step_cases(layers: int, iters: int, kv: str):
    """Decode batches over `layers` layers' pools, best of `iters` passes over all of them."""
    print(f"threads={torch.get_num_threads()}  H={H} KVH={KVH} D={D} block={BS}  ({layers} "
          f"layers' pools, {kv}, best of {iters})")
    print(f"{'case':<22}{'kernel ms':>11}{'ns a key-row':>14}")
    for name, seqs in {"decode b=32 ctx=192": [(191, 1)] * 32,
                       "decode b=32 ctx=512": [(511, 1)] * 32,
                       "decode b=1 ctx=2048": [(2047, 1)]}.items():
        args = [make_inputs(seqs, kv=kv, seed=i) for i in range(layers)]

        def step(*_):
            for x in args:
                torch.ops.kiln.paged_attention(*x)
        t = timeit(step, (), iters)
        rows = layers * KVH * sum(c + n for c, n in seqs)
        print(f"{name:<22}{t * 1e3:>11.3f}{t / rows * 1e9:>14.2f}")


def window_cases(window: int, iters: int, kv: str):
    """Decode over a 2048-token context: every key vs the last `window` keys."""
    print(f"{'case':<22}{'global ms':>11}{f'window {window} ms':>18}{'speedup':>9}")
    for name, seqs in {"decode b=1 ctx=2048": [(2047, 1)],
                       "decode b=8 ctx=2048": [(2047, 1)] * 8}.items():
        args = make_inputs(seqs, kv=kv)
        tg = timeit(torch.ops.kiln.paged_attention, args, iters)
        tw = timeit(torch.ops.kiln.paged_attention, args + (window, 0.0), iters)
        print(f"{name:<22}{tg * 1e3:>11.3f}{tw * 1e3:>18.3f}{tg / tw:>8.1f}x")


if __name__ == "__main__":
    main()
