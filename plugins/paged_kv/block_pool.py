"""The KV block pool: pure-Python accounting of the paged KV pools' blocks.

The pool hands out block ids; it never touches a tensor. The executor owns the tensors
(`[num_blocks, tokens_per_block, kv_heads, row]` per layer: kv_format), the scheduler owns the
policy (who gets blocks, who is preempted); the pool only counts.

Prefix caching: a *full* block whose K/V has been computed is identified by a chained hash

    h(block i) = hash((h(block i-1), token ids of block i))      h(block -1) = ROOT

so equal hashes mean equal whole prefixes. A new sequence reuses the longest run of cached
blocks matching its first tokens and does not recompute them. A block nobody references any
more keeps its K/V and its hash and sits in an LRU list; it is evicted (hash forgotten,
block reused) only when a fresh block is needed and no never-used block is left.

    block states:  free (no hash, ref 0) -> in use (ref >= 1) -> cached (hash, ref 0) -> ...
                   cached --prefix hit--> in use;   cached --evicted--> in use (new owner)

Verbs: `hash_blocks`, `can_allocate`, `allocate`, `can_append`, `may_append`, `truncate`,
`cache_blocks`, `free`.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

ROOT_HASH = 0x6B696C6E  # parent hash of a sequence's first block


def root_hash(salt: Optional[str]) -> int:
    """The parent hash of a first block: ROOT_HASH, or one of its own per salt (a LoRA
    adapter: two adapters never share K/V of equal tokens)."""
    return ROOT_HASH if salt is None else hash((ROOT_HASH, salt))


@dataclass
class KVBlock:
    """One fixed-size block of the KV pool: its id, its references and, once full, its
    prefix hash (the K/V itself lives in the executor's pools)."""
    block_id: int
    ref_count: int = 0
    hash: int | None = None          # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] = ()  # the block's tokens, kept to rule out hash collisions


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    used_blocks: int       # referenced by at least one sequence
    free_blocks: int       # allocatable now: never used + cached-unreferenced
    cached_blocks: int     # unreferenced blocks still holding reusable K/V (evictable)
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int      # of those, tokens found cached (not recomputed)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class BlockPool:
    """A fixed pool of `num_blocks` blocks of `tokens_per_block` tokens each."""

    def __init__(self, num_blocks: int, tokens_per_block: int, prefix_caching: bool = True):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and tokens_per_block >= 1 "
                             f"(got {num_blocks}, {tokens_per_block})")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.prefix_caching = prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))      # ref 0, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()    # ref 0, hashed; LRU first
        self._by_hash: dict[int, int] = {}                      # hash -> block id
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (never used, or cached and unreferenced)."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.tokens_per_block)

    def stats(self) -> PoolStats:
        free = self.num_free_blocks
        return PoolStats(self.num_blocks, self.num_blocks - free, free, len(self._cached),
                         self.prefix_queried_tokens, self.prefix_hit_tokens)

    # ---- hashing ----------------------------------------------------------------------------
    def hash_blocks(self, token_ids: Sequence[int], parent_hashes: Sequence[int] = (),
                    salt: Optional[str] = None) -> list[int]:
        """Chained hashes of the full blocks of `token_ids`; extends `parent_hashes` (the hashes
        of its first blocks, already computed) instead of rehashing them. `salt` (a LoRA
        adapter's name) starts another chain: equal tokens under two salts never share K/V."""
        bs = self.tokens_per_block
        out = list(parent_hashes)
        h = out[-1] if out else root_hash(salt)
        for i in range(len(out), len(token_ids) // bs):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def cached_prefix_len(self, token_ids: Sequence[int], hashes: Sequence[int]) -> int:
        """Leading tokens of `token_ids` an allocation now would find in the prefix cache."""
        return len(self._match(token_ids, hashes)) * self.tokens_per_block

    def _match(self, token_ids: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, leaving >= 1 token to compute (the last
        token must run through the model to produce logits)."""
        if not self.prefix_caching:
            return []
        bs = self.tokens_per_block
        limit = (len(token_ids) - 1) // bs
        hit = []
        for i, h in enumerate(hashes[:limit]):
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hit.append(bid)
        return hit

    # ---- allocation --------------------------------------------------------------------------
    def can_allocate(self, token_ids: Sequence[int], hashes: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether `allocate(token_ids, hashes)` would succeed with `reserve` blocks still free
        afterwards (the guaranteed-no-evict policy reserves a sequence's future blocks)."""
        hit = self._match(token_ids, hashes)
        # a hit on an unreferenced cached block takes it out of the free count too
        taken = self.blocks_for(len(token_ids)) - len(hit)
        taken += sum(1 for b in hit if self.blocks[b].ref_count == 0)
        return taken + reserve <= self.num_free_blocks

    def allocate(self, token_ids: Sequence[int], hashes: Sequence[int] = ()) -> tuple[list[int], int]:
        """Blocks for a new (or resumed) sequence of `token_ids` -> (block table, number of
        leading tokens whose K/V is already cached). `hashes` = hash_blocks(token_ids)."""
        n = self.blocks_for(len(token_ids))
        hit = self._match(token_ids, hashes)
        if n - len(hit) + sum(1 for b in hit if self.blocks[b].ref_count == 0) > self.num_free_blocks:
            raise RuntimeError(f"block pool exhausted: {n} blocks needed, "
                               f"{self.num_free_blocks} free (check can_allocate first)")
        for bid in hit:
            self._ref(bid)
        table = hit + [self._take() for _ in range(n - len(hit))]
        cached = len(hit) * self.tokens_per_block
        if self.prefix_caching:
            self.prefix_queried_tokens += len(token_ids)
            self.prefix_hit_tokens += cached
        return table, cached

    def can_append(self, block_table: Sequence[int], num_tokens: int) -> bool:
        """Whether the table can grow to hold `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free_blocks

    def may_append(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to hold `num_tokens` tokens (no-op when it already does)."""
        for _ in range(self.blocks_for(num_tokens) - len(block_table)):
            block_table.append(self._take())

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink `block_table` in place to the blocks `num_tokens` tokens need, freeing the
        rest (the KV of rejected draft positions is rolled back by length)."""
        keep = self.blocks_for(num_tokens)
        if len(block_table) > keep:
            self.free(block_table[keep:])
            del block_table[keep:]

    def cache_blocks(self, block_table: Sequence[int], token_ids: Sequence[int],
                     num_computed_tokens: int, salt: Optional[str] = None) -> None:
        """Register the blocks that are now full and computed in the prefix cache (`salt`:
        as hash_blocks')."""
        if not self.prefix_caching:
            return
        bs = self.tokens_per_block
        full = min(num_computed_tokens, len(token_ids)) // bs
        first = full  # walk back to the first full block not yet hashed
        while first > 0 and self.blocks[block_table[first - 1]].hash is None:
            first -= 1
        parent = self.blocks[block_table[first - 1]].hash if first else root_hash(salt)
        for i in range(first, full):
            block = self.blocks[block_table[i]]
            block.token_ids = tuple(token_ids[i * bs:(i + 1) * bs])
            block.hash = parent = hash((parent, block.token_ids))
            self._by_hash.setdefault(parent, block.block_id)  # first writer stays canonical

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference to each block of a finished/preempted/cancelled sequence.
        Freed in reverse so a sequence's tail blocks are evicted before its prefix."""
        for bid in reversed(block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                if block.hash is not None and self._by_hash.get(block.hash) == bid:
                    self._cached[bid] = None
                else:
                    self._forget(block)
                    self._free.append(bid)

    # ---- internals ------------------------------------------------------------------------------
    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            self._cached.pop(bid, None)
        block.ref_count += 1

    def _take(self) -> int:
        if self._free:
            bid = self._free.popleft()
        elif self._cached:
            bid, _ = self._cached.popitem(last=False)  # evict the least recently used
            self._forget(self.blocks[bid])
        else:
            raise RuntimeError("block pool exhausted (check can_allocate/can_append first)")
        self.blocks[bid].ref_count = 1
        return bid

    def _forget(self, block: KVBlock) -> None:
        if block.hash is not None and self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
        block.hash, block.token_ids = None, ()
