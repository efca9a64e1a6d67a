"""Shared test helpers: a tiny greedy generator over LlamaModel with paged KV caches.

The generator drives the packed engine step the way the runtime does: all prompts are
prefilled together in one step (packed along T), then every sequence decodes one token per
step. Blocks are handed out contiguously or shuffled (to catch block-table bugs).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from builder.arch.llama import LlamaModel


@dataclass
class Generated:
    tokens: list[list[int]]                 # new tokens per prompt (stopped at eos if given)
    prefill_logits: torch.Tensor            # [B, vocab] logits at each prompt's last position
    step_logits: list[list[torch.Tensor]] = field(default_factory=list)  # per seq, per new token


def greedy_generate(model: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    tokens_per_block: int = 4, shuffle_blocks: bool = False, seed: int = 0,
                    eos_ids: Optional[Sequence[int]] = None) -> Generated:
    """Greedy decoding of `prompts` (lists of ids) through paged caches; eager mode."""
    cfg = model.cfg
    B = len(prompts)
    bs = tokens_per_block
    max_len = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-max_len // bs)
    num_blocks = B * per_seq + 1                       # block 0 unused: catches off-by-ones
    ids = list(range(1, num_blocks))
    if shuffle_blocks:
        random.Random(seed).shuffle(ids)
    block_tables = torch.tensor([ids[b * per_seq:(b + 1) * per_seq] for b in range(B)])
    dtype = next(model.parameters()).dtype
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
    v_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]

    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in range(B)]
    logits_hist: list[list[torch.Tensor]] = [[] for _ in range(B)]
    computed = [0] * B                                 # tokens already in the KV pool
    active = list(range(B))
    prefill_logits = None
    with torch.no_grad():
        while active:
            input_ids, positions, slots, qsl = [], [], [], [0]
            for b in active:
                chunk = range(computed[b], len(seqs[b]))
                input_ids += [seqs[b][p] for p in chunk]
                positions += list(chunk)
                slots += [int(block_tables[b, p // bs]) * bs + p % bs for p in chunk]
                qsl.append(qsl[-1] + len(chunk))
            logits = model(torch.tensor(input_ids), torch.tensor(positions),
                           torch.tensor(slots), block_tables[active],
                           torch.tensor([len(seqs[b]) for b in active]),
                           torch.tensor(qsl), torch.tensor(qsl[1:]) - 1, k_caches, v_caches)
            if prefill_logits is None:
                prefill_logits = logits.clone()
            still = []
            for row, b in enumerate(active):
                computed[b] = len(seqs[b])
                tok = int(logits[row].argmax())
                seqs[b].append(tok)
                new[b].append(tok)
                logits_hist[b].append(logits[row].clone())
                done = len(new[b]) >= max_new_tokens or (eos_ids and tok in eos_ids)
                if not done:
                    still.append(b)
            active = still
    return Generated(new, prefill_logits, logits_hist)
