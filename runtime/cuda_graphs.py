"""CUDA graphs for decode-only engine steps, so a small model is not bound by kernel launches.

A decode-only step schedules one token per sequence (T == B). For each size S of a ladder
(1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to max_batch_size) the compiled step is captured
once, at load, over static input buffers; a step of B <= S sequences copies its inputs into
the first B rows and replays the graph. The other S - B rows are padding:

    row i >= B:  token 0 at position 0 of a sequence of context 1 whose one block is the
                 scratch block; its K/V land in the scratch block's slot 0, its logits row is
                 dropped. The scratch block is the pool's last, which the block pool never
                 hands out (so padding never touches a real sequence's KV).

Mixed steps (any prefill chunk) and batches wider than the largest graph run the compiled
step directly. The pools must stay at the addresses the graphs were captured with: the
executor allocates them once and writes them in place, as it does without graphs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kiln.runtime.executor import STEP_INPUTS, ModelInput


def batch_ladder(max_batch_size: int) -> list[int]:
    """Graph sizes: powers of two up to 16, then steps of a quarter of the size (vLLM's
    ladder has the same shape): padding wastes at most ~25% of a step."""
    sizes, s = [], 1
    while s < min(16, max_batch_size):
        sizes.append(s)
        s *= 2
    while s < max_batch_size:
        sizes.append(s)
        s += max(8, s // 4)
    sizes.append(max_batch_size)
    return sorted(set(sizes))


def is_decode_only(batch: ModelInput) -> bool:
    return batch.input_ids.shape[0] == batch.context_lens.shape[0]


# Inputs a decode step copies into a graph's buffers: its token and sequence rows (T == B).
# The others ("B+1" offsets, "N" logit rows) are 0..S and 0..S-1 for every B: fixed at creation.
_COPIED = tuple(s.name for s in STEP_INPUTS if s.rows in ("T", "B"))


def padding_batch(size: int, max_blocks: int, scratch_block: int, tokens_per_block: int,
                  device) -> ModelInput:
    """A decode step of `size` padding rows (see the module docstring), packed by the one
    packer: each row token 0 at position 0 of a sequence whose every block is the scratch."""
    return ModelInput.build([[0]] * size, [0] * size, [[scratch_block] * max_blocks] * size,
                            tokens_per_block).to(device)


class _Buffers:
    """The static inputs of one captured size, and the padding they are reset to."""

    def __init__(self, size: int, max_blocks: int, scratch_block: int, tokens_per_block: int,
                 device):
        self.step = padding_batch(size, max_blocks, scratch_block, tokens_per_block, device)
        self.padding = padding_batch(size, max_blocks, scratch_block, tokens_per_block, device)

    def load(self, batch: ModelInput) -> None:
        """Copy a decode-only batch in (its rows, its block tables' width); reset the rest
        (rows B.., block-table columns past the batch's width) to padding."""
        for name in _COPIED:
            dst, src, pad = (getattr(b, name) for b in (self.step, batch, self.padding))
            dst[tuple(slice(0, n) for n in src.shape)].copy_(src, non_blocking=True)
            for d, n in enumerate(src.shape):   # the part of dst beyond src along dim d
                rest = tuple(slice(0, m) for m in src.shape[:d]) + (slice(n, None),)
                dst[rest].copy_(pad[rest], non_blocking=True)


def pad_decode_batch(batch: ModelInput, size: int, max_blocks: int, scratch_block: int,
                     tokens_per_block: int) -> ModelInput:
    """The decode-only `batch` as the size-`size` batch a graph replays (a new ModelInput)."""
    if not is_decode_only(batch):
        raise ValueError("only decode-only batches (one token per sequence) are padded")
    B = batch.input_ids.shape[0]
    if B > size or batch.block_tables.shape[1] > max_blocks:
        raise ValueError(f"a batch of {B} x {batch.block_tables.shape[1]} blocks does not fit "
                         f"a graph of {size} x {max_blocks}")
    buf = _Buffers(size, max_blocks, scratch_block, tokens_per_block, batch.input_ids.device)
    buf.load(batch)
    return buf.step


class DecodeGraphs:
    """Captured decode steps at the ladder's sizes, over fixed KV pools (CUDA only)."""

    def __init__(self, step_fn: Callable[..., torch.Tensor], k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor], max_batch_size: int, max_blocks: int,
                 scratch_block: int, tokens_per_block: int):
        if not k_caches[0].is_cuda:
            raise ValueError("CUDA graphs need the KV pools on a CUDA device")
        self.step_fn, self.k_caches, self.v_caches = step_fn, list(k_caches), list(v_caches)
        self.max_blocks, self.scratch_block = max_blocks, scratch_block
        self.tokens_per_block = tokens_per_block
        self.sizes = batch_ladder(max_batch_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, _Buffers, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (later captures reuse its memory pool)."""
        pool = None
        device = self.k_caches[0].device
        for size in sorted(self.sizes, reverse=True):
            buf = _Buffers(size, self.max_blocks, self.scratch_block, self.tokens_per_block,
                           device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):          # warm-up: allocator, lazy initialization
                for _ in range(2):
                    self.step_fn(*buf.step.args(), self.k_caches, self.v_caches)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step_fn(*buf.step.args(), self.k_caches, self.v_caches)
            pool = graph.pool()
            self._graphs[size] = (graph, buf, out)
        torch.cuda.synchronize(device)

    def can_run(self, batch: ModelInput) -> bool:
        return (is_decode_only(batch) and batch.input_ids.shape[0] <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks and bool(self._graphs))

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> torch.Tensor:
        """Replay the smallest graph that holds `batch` -> logits [B, vocab] (a copy)."""
        B = batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= B)
        graph, buf, out = self._graphs[size]
        buf.load(batch)
        graph.replay()
        return out[:B].clone()
