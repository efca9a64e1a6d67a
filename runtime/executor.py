"""The executor: owns the paged KV pools and runs one compiled engine step on a packed batch.

The model runner (runtime/model_runner.py) and the accuracy gate hand it one `ModelInput` per
step, packed by `ModelInput.build` (the one packer; the build's compiled-vs-eager check packs
with it too), and get logits back; the executor never decides policy (which sequences, which blocks) — that is the scheduler's and
the block pool's job.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kiln.contracts.manifest import KVCacheSection
from kiln.plugins.paged_kv import kv_format
from kiln.runtime.lora_buffers import LoraBuffers
from kiln.runtime.plan import Plan, PlanError, load_step_fn


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV pools: per layer, K and V of [num_blocks, tokens_per_block, kvh, row]
    (row = head_dim, or head_dim codes + 4 scale bytes for an int8/fp8 cache), each kv head's
    rows of a block stored together (kv_format.new_pools)."""
    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "fp32"
    pool_order: str = kv_format.POOL_ORDER   # the plan's kv_cache.pool_order

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block summed over all layers (scales included)."""
        return self.tokens_per_block * kv_format.bytes_per_token(
            self.dtype, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @classmethod
    def for_budget(cls, budget_bytes: int, num_layers: int, tokens_per_block: int,
                   num_kv_heads: int, head_dim: int, dtype: str,
                   pool_order: str = kv_format.POOL_ORDER) -> "KVLayout":
        probe = cls(num_layers, 1, tokens_per_block, num_kv_heads, head_dim, dtype)
        n = budget_bytes // probe.bytes_per_block
        if n < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds {n} blocks of "
                             f"{probe.bytes_per_block} bytes; raise kv_cache.memory")
        return cls(num_layers, int(n), tokens_per_block, num_kv_heads, head_dim, dtype,
                   pool_order)


def available_memory() -> int:
    """Bytes of memory available to a new allocation on this host (Linux MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def resolve_kv_budget(kv: KVCacheSection) -> int:
    """The KV pool budget in bytes from the plan's kv_cache section (bytes or a fraction)."""
    if kv.budget_fraction:
        return int(available_memory() * kv.budget_fraction)
    return int(kv.budget_bytes)


@dataclass(frozen=True)
class StepInputSpec:
    """One engine-step input: its name, dtype and shape in the step's symbolic dims (T: the
    packed tokens, B: the sequences, max_blocks: the widest block table, N: the logit rows)."""
    name: str
    dtype: torch.dtype
    dims: tuple[str, ...]

    @property
    def rows(self) -> str:
        """What one row (index along dim 0) is: "T" a token, "B" a sequence, else a fixed
        layout of the step ("B+1" offsets, "N" logit rows)."""
        return self.dims[0]


def _step_input(dtype: torch.dtype, *dims: str):
    return field(metadata={"dtype": dtype, "dims": dims})


@dataclass
class ModelInput:
    """The tensors of one engine step, exactly DESIGN.md's engine-step inputs, in the order
    the compiled step takes them. This is their one declaration: STEP_INPUTS (the export's
    example inputs and dynamic dims, the CUDA-graph buffers) is read from these fields."""
    # [T] tokens, sequence after sequence
    input_ids: torch.Tensor = _step_input(torch.int64, "T")
    # [T] position of each token in its sequence
    positions: torch.Tensor = _step_input(torch.int64, "T")
    # [T] flat KV slot of each token
    slot_mapping: torch.Tensor = _step_input(torch.int64, "T")
    # [B, max_blocks] each sequence's block ids
    block_tables: torch.Tensor = _step_input(torch.int32, "B", "max_blocks")
    # [B] KV length of each sequence after this step
    context_lens: torch.Tensor = _step_input(torch.int32, "B")
    # [B+1] offset of each sequence's tokens along T
    query_start_loc: torch.Tensor = _step_input(torch.int32, "B+1")
    # [N] rows whose logits are wanted (the engine: the last scheduled token of each sequence)
    logits_indices: torch.Tensor = _step_input(torch.int64, "N")

    @classmethod
    def build(cls, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
              block_tables: Sequence[Sequence[int]], tokens_per_block: int,
              logits_indices: Optional[Sequence[int]] = None) -> "ModelInput":
        """The one packer (serving, the build's compiled-vs-eager check, the accuracy gate).

        From, per sequence: the tokens scheduled this step, the position of the first of them
        (= tokens already in the KV) and the sequence's block ids. logits_indices: the rows
        whose logits are wanted (default: each sequence's last scheduled token). numpy: the
        Python work is per sequence, not per token.

            token_ids  [a0 a1 a2] [b0]           starts [0, 5]    tokens_per_block 4
            input_ids  a0 a1 a2 b0               query_start_loc 0 3 4
            positions   0  1  2  5               context_lens    3 6
            slots      from each position's block: table[p // 4] * 4 + p % 4
        """
        B, bs = len(token_ids), tokens_per_block
        width = max(1, max(len(b) for b in block_tables))
        bt = np.zeros((B, width), dtype=np.int32)
        for i, b in enumerate(block_tables):
            bt[i, :len(b)] = b
        if logits_indices is None and all(len(t) == 1 for t in token_ids):
            return cls._decode(token_ids, starts, bt, bs)
        counts = np.fromiter((len(t) for t in token_ids), np.int64, B)
        first = np.asarray(starts, dtype=np.int64).reshape(B)
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_idx = np.repeat(np.arange(B), counts)
        positions = np.arange(qsl[-1], dtype=np.int64) - qsl[seq_idx] + first[seq_idx]
        slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        rows = (qsl[1:] - 1 if logits_indices is None
                else np.asarray(logits_indices, dtype=np.int64).reshape(-1))
        return cls(
            input_ids=torch.tensor(list(itertools.chain.from_iterable(token_ids)),
                                   dtype=torch.int64),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(bt),
            context_lens=torch.from_numpy((first + counts).astype(np.int32)),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            logits_indices=torch.from_numpy(rows),
        )

    @classmethod
    def _decode(cls, token_ids: Sequence[Sequence[int]], starts: Sequence[int], bt: np.ndarray,
                bs: int) -> "ModelInput":
        """build() when every sequence brings one token (decode steps): the same tensors from
        fewer numpy calls. Each step's Python runs right after the weights streamed through
        the caches, so every call is a cold one, and fewer calls are measurably cheaper than
        the general packing (figures: docs/JOURNAL.md, "Figures moved out of code comments")."""
        B = len(token_ids)
        pos = np.array(starts, dtype=np.int64).reshape(B)
        ar = np.arange(B + 1, dtype=np.int64)
        return cls(
            input_ids=torch.from_numpy(np.array([t[0] for t in token_ids], dtype=np.int64)),
            positions=torch.from_numpy(pos),
            slot_mapping=torch.from_numpy(bt[ar[:B], pos // bs].astype(np.int64) * bs
                                          + pos % bs),
            block_tables=torch.from_numpy(bt),
            context_lens=torch.from_numpy((pos + 1).astype(np.int32)),
            query_start_loc=torch.from_numpy(ar.astype(np.int32)),
            logits_indices=torch.from_numpy(ar[:B]),
        )

    def args(self) -> tuple:
        """The tensors in STEP_INPUTS order (the compiled step's positional inputs)."""
        return _step_args(self)

    def to(self, device) -> "ModelInput":
        """The same step on `device`."""
        return ModelInput(*(t.to(device) for t in self.args()))


STEP_INPUTS: tuple[StepInputSpec, ...] = tuple(
    StepInputSpec(f.name, f.metadata["dtype"], f.metadata["dims"]) for f in fields(ModelInput))
_step_args = operator.attrgetter(*(s.name for s in STEP_INPUTS))


class Executor:
    """Runs a step function over KV pools it allocates once and writes in place."""

    def __init__(self, step_fn: Callable[..., torch.Tensor], layout: KVLayout,
                 device: str = "cpu", lora: Optional[LoraBuffers] = None):
        self.step_fn = step_fn
        self.layout = layout
        self.lora = lora          # a plan with lora: the adapter slots its step reads
        self.k_caches, self.v_caches = kv_format.new_pools(
            layout.dtype, layout.num_layers, layout.num_blocks, layout.tokens_per_block,
            layout.num_kv_heads, layout.head_dim, device, layout.pool_order)

    @torch.inference_mode()
    def execute(self, batch: ModelInput, lora_slots: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """-> logits [B, vocab] float32. lora_slots [T]: each token's adapter slot (a plan
        with lora; None: every token on the base model)."""
        if self.lora is None:
            if lora_slots is not None:
                raise ValueError("this plan was built without lora: it takes no adapters")
            return self.step_fn(*batch.args(), self.k_caches, self.v_caches)
        if lora_slots is None:
            lora_slots = torch.full(batch.input_ids.shape, -1, dtype=torch.int64)
        return self.step_fn(*batch.args(), self.k_caches, self.v_caches,
                            *self.lora.args(lora_slots))

    @classmethod
    def from_plan(cls, plan: Plan, kv_budget_bytes: int | None = None) -> "Executor":
        """Load the plan's engine and allocate its KV pools from the budget (plan's default)."""
        shape, kv = plan.shape, plan.manifest.kv_cache
        budget = kv_budget_bytes or resolve_kv_budget(kv)
        try:
            layout = KVLayout.for_budget(budget, shape.num_layers, kv.tokens_per_block,
                                         shape.num_kv_heads, shape.head_dim, kv.dtype,
                                         kv.pool_order)
        except ValueError as e:
            raise PlanError(f"plan {plan.path}: {e}") from None
        lora = plan.manifest.lora
        return cls(load_step_fn(plan), layout,
                   lora=None if lora is None else LoraBuffers(lora, shape.num_layers))
