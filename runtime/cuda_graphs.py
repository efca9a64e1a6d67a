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

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kiln.runtime.executor import ModelInput


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


@dataclass
class _Buffers:
    """The static inputs of one captured size (row for row, ModelInput's fields)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def padding(cls, size: int, max_blocks: int, scratch_block: int, tokens_per_block: int,
                device) -> "_Buffers":
        """Buffers whose every row is a padding row (see the module docstring)."""
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)
        return cls(input_ids=full((size,), 0, torch.int64),
                   positions=full((size,), 0, torch.int64),
                   slot_mapping=full((size,), scratch_block * tokens_per_block, torch.int64),
                   block_tables=full((size, max_blocks), scratch_block, torch.int32),
                   context_lens=full((size,), 1, torch.int32),
                   query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                   logits_indices=torch.arange(size, dtype=torch.int64, device=device))

    def args(self) -> tuple:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                self.context_lens, self.query_start_loc, self.logits_indices)

    def load(self, batch: ModelInput, scratch_block: int, tokens_per_block: int) -> None:
        """Copy a decode-only batch of B rows in; reset rows B.. to padding."""
        B, width = batch.input_ids.shape[0], batch.block_tables.shape[1]
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            dst = getattr(self, name)
            dst[:B].copy_(getattr(batch, name), non_blocking=True)
        self.input_ids[B:] = 0
        self.positions[B:] = 0
        self.slot_mapping[B:] = scratch_block * tokens_per_block
        self.context_lens[B:] = 1
        self.block_tables[:B, :width].copy_(batch.block_tables, non_blocking=True)
        self.block_tables[:B, width:] = scratch_block   # never read: beyond each context
        self.block_tables[B:] = scratch_block
        # query_start_loc and logits_indices of a decode-only batch are 0..S and 0..S-1 for
        # every B: fixed at creation.


def pad_decode_batch(batch: ModelInput, size: int, max_blocks: int, scratch_block: int,
                     tokens_per_block: int) -> ModelInput:
    """The decode-only `batch` as the size-`size` batch a graph replays (a new ModelInput)."""
    if not is_decode_only(batch):
        raise ValueError("only decode-only batches (one token per sequence) are padded")
    B = batch.input_ids.shape[0]
    if B > size or batch.block_tables.shape[1] > max_blocks:
        raise ValueError(f"a batch of {B} x {batch.block_tables.shape[1]} blocks does not fit "
                         f"a graph of {size} x {max_blocks}")
    buf = _Buffers.padding(size, max_blocks, scratch_block, tokens_per_block,
                           batch.input_ids.device)
    buf.load(batch, scratch_block, tokens_per_block)
    return ModelInput(*buf.args())


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
            buf = _Buffers.padding(size, self.max_blocks, self.scratch_block,
                                   self.tokens_per_block, device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):          # warm-up: allocator, lazy initialization
                for _ in range(2):
                    self.step_fn(*buf.args(), self.k_caches, self.v_caches)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step_fn(*buf.args(), self.k_caches, self.v_caches)
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
        buf.load(batch, self.scratch_block, self.tokens_per_block)
        graph.replay()
        return out[:B].clone()
