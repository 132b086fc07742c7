"""KV pool accounting: which cache blocks and state slots each sequence owns.

The model's cache keeps two kinds of state per sequence (MODEL_SPEC.md §7):
- fixed-size state (sliding windows, open compression windows) in one *slot* per sequence;
- growing state (compressed entries, indexer keys) in *blocks* of `block_size` tokens, listed in
  the sequence's block table.
This module only counts; the tensors live in the model's cache object.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer_core.engine.sequence import Sequence

__all__ = ["KVCacheManager", "KVPoolPlan", "KVPoolTooSmallError", "plan_kv_pool"]


class KVPoolTooSmallError(RuntimeError):
    """The KV pool cannot hold what the engine needs to run."""


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    num_blocks: int
    block_size: int
    num_slots: int


def plan_kv_pool(
    *,
    bytes_per_block: int,
    bytes_per_slot: int,
    num_slots: int,
    block_size: int,
    available_bytes: int,
    num_blocks: int | None,
    max_useful_blocks: int,
) -> KVPoolPlan:
    """Size the pool: an explicit block count, or as many blocks as `available_bytes` holds once
    every slot has its fixed state, but no more than every slot at full context could use."""
    if num_blocks is None:
        spare = available_bytes - bytes_per_slot * num_slots
        fit = spare // bytes_per_block if bytes_per_block > 0 else max_useful_blocks
        if spare < 0 or fit < 1:
            raise KVPoolTooSmallError(
                f"{available_bytes} bytes for the KV pool hold {num_slots} sequence slots "
                f"({bytes_per_slot} B each) but not one block of {block_size} tokens "
                f"({bytes_per_block} B); raise kv_cache_memory_fraction or lower max_num_seqs"
            )
        num_blocks = min(fit, max_useful_blocks)
    return KVPoolPlan(num_blocks=int(num_blocks), block_size=block_size, num_slots=num_slots)


class KVCacheManager:
    def __init__(self, plan: KVPoolPlan) -> None:
        self.block_size = plan.block_size
        self.num_blocks = plan.num_blocks
        self.num_slots = plan.num_slots
        # NOTE: blocks never handed out are counted, not listed: a pool sized from free memory
        # can hold millions of blocks.
        self._released_blocks: list[int] = []
        self._next_unused_block = 0
        self._free_slots: deque[int] = deque(range(plan.num_slots))

    @property
    def num_free_blocks(self) -> int:
        return len(self._released_blocks) + self.num_blocks - self._next_unused_block

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to `num_tokens` cached tokens from what is free now."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        return missing <= self.num_free_blocks and (seq.slot_id >= 0 or bool(self._free_slots))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if not self.can_hold(seq, num_tokens):
            raise KVPoolTooSmallError(
                f"sequence {seq.seq_id} needs {self.blocks_for(num_tokens)} blocks, "
                f"{self.num_free_blocks} free; call can_hold first"
            )
        if seq.slot_id < 0:
            seq.slot_id = self._free_slots.popleft()
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_block())

    def release(self, seq: Sequence) -> None:
        self._released_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        if seq.slot_id >= 0:
            self._free_slots.append(seq.slot_id)
            seq.slot_id = -1

    def _take_block(self) -> int:
        if self._released_blocks:
            return self._released_blocks.pop()
        self._next_unused_block += 1
        return self._next_unused_block - 1
