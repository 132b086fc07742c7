"""KV pool accounting: which cache blocks and state slots each sequence owns.

The model's cache keeps two kinds of state per sequence (MODEL_SPEC.md §7):
- fixed-size state (sliding windows, open compression windows) in one *slot* per sequence;
- growing state (compressed entries, indexer keys) in *blocks* of `block_size` tokens, listed in
  the sequence's block table.
This module only counts; the tensors live in the model's cache object. With prefix caching
(prefix_cache.py) blocks are reference-counted: a cached block may sit in several block tables, and
a released cached block stays reusable until the pool needs it back. Snapshot slots (exact prefix
reuse) follow the sequences' slots in the cache: slots num_slots .. num_slots + num_snapshots - 1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer_core.engine.prefix_cache import (
    PrefixCache,
    PrefixHit,
    PrefixReuse,
    chain_hashes,
)
from deepinfer_core.engine.sequence import Sequence

__all__ = ["KVCacheManager", "KVPoolPlan", "KVPoolTooSmallError", "plan_kv_pool"]


class KVPoolTooSmallError(RuntimeError):
    """The KV pool cannot hold what the engine needs to run."""


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    num_blocks: int
    block_size: int
    num_slots: int
    num_snapshots: int = 0   # exact prefix reuse: slot-sized window snapshots after the sequences' slots


def plan_kv_pool(
    *,
    bytes_per_block: int,
    bytes_per_slot: int,
    num_slots: int,
    block_size: int,
    available_bytes: int,
    num_blocks: int | None,
    max_useful_blocks: int,
    num_snapshots: int = 0,
) -> KVPoolPlan:
    """Size the pool: an explicit block count, or as many blocks as `available_bytes` holds once
    every slot (and snapshot slot) has its fixed state, but no more than every slot at full context
    could use."""
    if num_blocks is None:
        spare = available_bytes - bytes_per_slot * (num_slots + num_snapshots)
        fit = spare // bytes_per_block if bytes_per_block > 0 else max_useful_blocks
        if spare < 0 or fit < 1:
            raise KVPoolTooSmallError(
                f"{available_bytes} bytes for the KV pool hold {num_slots} sequence slots "
                f"({bytes_per_slot} B each) but not one block of {block_size} tokens "
                f"({bytes_per_block} B); raise kv_cache_memory_fraction or lower max_num_seqs"
            )
        num_blocks = min(fit, max_useful_blocks)
    return KVPoolPlan(num_blocks=int(num_blocks), block_size=block_size, num_slots=num_slots,
                      num_snapshots=num_snapshots)


class KVCacheManager:
    def __init__(self, plan: KVPoolPlan, prefix_reuse: PrefixReuse | None = None) -> None:
        self.block_size = plan.block_size
        self.num_blocks = plan.num_blocks
        self.num_slots = plan.num_slots
        # NOTE: blocks never handed out are counted, not listed: a pool sized from free memory
        # can hold millions of blocks.
        self._released_blocks: list[int] = []
        self._next_unused_block = 0
        self._free_slots: deque[int] = deque(range(plan.num_slots))
        self._holders: dict[int, int] = {}  # block -> block tables listing it
        self.prefix = None if prefix_reuse is None else PrefixCache(prefix_reuse, plan.block_size, plan.num_slots)

    @property
    def num_free_blocks(self) -> int:
        idle = len(self.prefix.idle) if self.prefix is not None else 0
        return len(self._released_blocks) + self.num_blocks - self._next_unused_block + idle

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether `seq` (starting from `hit`, if given) can grow to `num_tokens` cached tokens from
        what is free now."""
        held, free = len(seq.block_table), self.num_free_blocks
        if hit is not None:
            held += len(hit.blocks)
            free -= sum(block in self.prefix.idle for block in hit.blocks)
        return self.blocks_for(num_tokens) - held <= free and (seq.slot_id >= 0 or bool(self._free_slots))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if not self.can_hold(seq, num_tokens):
            raise KVPoolTooSmallError(
                f"sequence {seq.seq_id} needs {self.blocks_for(num_tokens)} blocks, "
                f"{self.num_free_blocks} free; call can_hold first"
            )
        if seq.slot_id < 0:
            seq.slot_id = self._free_slots.popleft()
        while len(seq.block_table) < self.blocks_for(num_tokens):
            block = self._take_block()
            self._holders[block] = 1
            seq.block_table.append(block)

    def release(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail of a prefix is the first to be evicted
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            del self._holders[block]
            if self.prefix is not None and self.prefix.is_cached(block):
                self.prefix.idle[block] = None
            else:
                self._released_blocks.append(block)
        seq.block_table = []
        if seq.slot_id >= 0:
            self._free_slots.append(seq.slot_id)
            seq.slot_id = -1

    def match_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The cached prefix a sequence about to be prefilled from scratch can start from."""
        if self.prefix is None or seq.num_computed_tokens or seq.block_table:
            return None
        known = seq.token_ids[:seq.num_tokens - seq.num_pending]
        seq.block_names = chain_hashes(known, self.block_size, seq.block_names)
        if seq.wants_prompt_logprobs:
            return None  # prompt log-probs need every prompt position computed
        return self.prefix.match(seq.block_names, len(known))

    def start_from(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """Admit `seq`: take over the hit's blocks and plan the exact-mode snapshot of its prefix."""
        if hit is not None:
            for block in hit.blocks:
                self._holders[block] = self._holders.get(block, 0) + 1
                self.prefix.idle.pop(block, None)
            seq.block_table = list(hit.blocks)
            seq.num_computed_tokens = hit.start
            if hit.snapshot_slot < 0:
                seq.window_start, seq.reused_len = hit.start, len(hit.blocks) * self.block_size
            self.prefix.record_hit(hit)
        if self.prefix is not None and self.prefix.reuse.mode == "exact" and seq.images is None:
            boundary = (seq.num_tokens - seq.num_pending - 1) // self.block_size * self.block_size
            if boundary > seq.num_computed_tokens and not self.prefix.has_snapshot(
                seq.block_names[boundary // self.block_size - 1]
            ):
                seq.snapshot_at = boundary

    def computed(self, seq: Sequence, start: int) -> int:
        """`seq` was scheduled to compute positions start .. seq.num_computed_tokens - 1: name the
        blocks that completes and return the snapshot slot its state goes to after the step (-1: none)."""
        if self.prefix is None or seq.images is not None:  # image spans share one token id: never cached
            return -1
        end = seq.num_computed_tokens
        # a bounded replay's state is approximate: never cached (an exact-mode replay covers the cone)
        if seq.window_start == 0 or self.prefix.reuse.mode == "exact":
            for k in range(start // self.block_size, min(end // self.block_size, len(seq.block_names))):
                self.prefix.register(seq.block_names[k], seq.block_table[k])
        if seq.snapshot_at and end == seq.snapshot_at:
            seq.snapshot_at = 0
            return self.prefix.new_snapshot(seq.block_names[end // self.block_size - 1])
        return -1

    def commit(self) -> None:
        """End of a scheduling round: what it registered becomes reusable by the next."""
        if self.prefix is not None:
            self.prefix.commit()

    def _take_block(self) -> int:
        if self._released_blocks:
            return self._released_blocks.pop()
        if self._next_unused_block < self.num_blocks:
            self._next_unused_block += 1
            return self._next_unused_block - 1
        return self.prefix.evict()
