"""Prefix caching: which cached blocks and window snapshots a new sequence can start from.

Blocks of `block_size` prompt tokens are named by a chained hash (a block's name covers every token
before it), so a cached block is reusable exactly when the whole prefix up to it matches. The paged
state of a block (compressed entries and indexer keys; V4.1: of every band) is final once its tokens
are computed, so a later sequence shares the block instead of recomputing it. Blocks no sequence
holds stay cached until the pool needs them back, least recently used first.

The sliding windows are per-slot rings, not paged (MODEL_SPEC_V41 §8-9), so a hit also needs the
window state at the reuse point B. Two modes:
- "exact": the engine copies a sequence's whole slot state (every layer's window ring, open groups,
  V4's compressor rings, V4.1's engram look-back) into a spare *snapshot slot* when its computed
  prefix reaches B = the last block boundary before its last known token, and copies it back on a
  hit at B. One snapshot costs one slot, `cache.bytes_per_slot`: V4.1 at release width 2,727,936 B
  with the fp8 window format (40 layers x 128 rows + open groups), 5,267,456 B with kv_cache_dtype
  bf16; V4 in bf16 adds its compressor rings (HCA keeps 128 raw tokens a layer) to 43 layers of
  128 x 1 KB windows. Snapshot slots come out of the KV pool's budget. The snapshot needs the state
  after exactly B positions, so the prefill chunk that would cross B ends there: a prompt that plans
  a snapshot takes one more step (its last < block_size tokens) before its first token. B is a
  multiple of every compress ratio (block_size is), so no group straddles it and no open group is
  carried; V4.1's engram look-back travels in the slot. Exact: the suffix runs the same math on the
  same state as without reuse; bitwise equal when computed in the same chunks (GEMM rows can differ
  in the last bit between chunkings, with or without reuse). DeepSeek-V4.1 also takes hits at any
  cached block boundary B without a snapshot when that saves more: it replays positions from
  R = B - num_layers*(W-1) (rounded down to a block) with no window KV below R, which reproduces
  every window at B exactly (the "window cone" below), so a shared system prompt longer than the
  cone is reused exactly even though no earlier prompt ended where it does.
- "bounded" (`decoder_replay_span` S, V4.1 only): no snapshot. A hit at B recomputes positions
  R..B-1 (R = B - S rounded down to a block boundary) attending no window KV below R, while the
  compressed entries and indexer keys of positions < B come from the cache and are not rewritten
  (`ForwardBatch.window_starts_cpu` / `reused_lens_cpu`). Approximate by construction: a window row
  of layer l depends on layer l-1's window over the W-1 rows before it, so rows within
  l*(W-1) of R differ; S >= num_layers*(W-1) reproduces the exact state. Blocks a bounded replay
  computes are not cached, so the cache only ever holds exact state.
Requests with images or asking for prompt log-probs never start from a cached prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig

__all__ = [
    "PrefixCache", "PrefixHit", "PrefixReuse", "PrefixReuseUnavailable", "chain_hashes", "prefix_reuse_for",
    "restore_slot_state",
]

ReuseMode = Literal["exact", "bounded"]


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    mode: ReuseMode = "exact"
    replay_span: int = 140          # bounded mode: tokens of a hit recomputed before the reuse point
    num_snapshots: int = 0          # exact mode: snapshot slots after the sequences' slots
    exact_cone: int = 0             # exact mode, V4.1: a replay this long reproduces every window exactly


@dataclass(frozen=True, slots=True)
class PrefixHit:
    blocks: list[int]               # cached blocks the sequence takes, in order
    start: int                      # first position it computes
    snapshot_slot: int              # exact: the slot state restored before its first step; -1 = none


def chain_hashes(token_ids: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Names of every full block of `token_ids`: `known` (the names of its first blocks) extended."""
    names = list(known)
    parent = names[-1] if names else b""
    for first in range(len(names) * block_size, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[first:first + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        names.append(parent)
    return names


class PrefixCache:
    """Block names <-> blocks, the idle cached blocks in LRU order, and the snapshot slots.

    Registrations made while a step is scheduled become visible only at `commit` (the end of that
    scheduling): the state is written by the step's forward, which runs before any later step."""

    def __init__(self, reuse: PrefixReuse, block_size: int, first_snapshot_slot: int) -> None:
        self.reuse = reuse
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()   # cached blocks with no holder, LRU first
        self._pending: list[tuple[bytes, int]] = []
        self._snapshot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free_snapshots = list(range(first_snapshot_slot + reuse.num_snapshots - 1, first_snapshot_slot - 1, -1))
        self._pending_snapshots: list[tuple[bytes, int]] = []
        self.num_hits = 0
        self.num_reused_tokens = 0      # positions never computed thanks to a hit
        self.num_replayed_tokens = 0    # bounded mode: positions of hits recomputed
        self.num_evicted_blocks = 0

    def is_cached(self, block: int) -> bool:
        return block in self._name_of

    def match(self, names: list[bytes], num_tokens: int) -> PrefixHit | None:
        """The longest usable hit for a sequence of `num_tokens` known tokens whose full blocks are
        `names`; at least its last token is left to compute (its logits are needed)."""
        usable = min(len(names), (num_tokens - 1) // self.block_size)
        matched = 0
        while matched < usable and names[matched] in self._block_of:
            matched += 1
        if self.reuse.mode == "exact":
            snapshotted = matched
            while snapshotted and names[snapshotted - 1] not in self._snapshot_of:
                snapshotted -= 1
            # a replay over the window cone is exact too: take whichever computes fewer positions
            if self.reuse.exact_cone and self._replay_start(matched, self.reuse.exact_cone) > snapshotted * self.block_size:
                return self._replay_hit(names, matched, self.reuse.exact_cone)
            if not snapshotted:
                return None
            snapshot = self._snapshot_of[names[snapshotted - 1]]
            self._snapshot_of.move_to_end(names[snapshotted - 1])
            blocks = [self._block_of[n] for n in names[:snapshotted]]
            return PrefixHit(blocks, snapshotted * self.block_size, snapshot)
        if not matched:
            return None
        return self._replay_hit(names, matched, self.reuse.replay_span)

    def _replay_start(self, matched: int, span: int) -> int:
        return max(0, matched * self.block_size - span) // self.block_size * self.block_size

    def _replay_hit(self, names: list[bytes], matched: int, span: int) -> PrefixHit:
        """Reuse `matched` cached blocks, recomputing the last `span` positions (rounded up to a block)
        with no window KV below them."""
        return PrefixHit([self._block_of[n] for n in names[:matched]], self._replay_start(matched, span), -1)

    def record_hit(self, hit: PrefixHit) -> None:
        self.num_hits += 1
        self.num_reused_tokens += hit.start
        if hit.snapshot_slot < 0:
            self.num_replayed_tokens += len(hit.blocks) * self.block_size - hit.start

    def has_snapshot(self, name: bytes) -> bool:
        return name in self._snapshot_of or any(n == name for n, _ in self._pending_snapshots)

    def register(self, name: bytes, block: int) -> None:
        """`block` will hold the block named `name` once the step being scheduled has run."""
        if name not in self._block_of and block not in self._name_of:
            self._pending.append((name, block))

    def new_snapshot(self, name: bytes) -> int:
        """A slot for the window state at the end of block `name` (evicting the least recently used),
        or -1 when every snapshot slot is being written by this step."""
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        elif self._snapshot_of:
            _, slot = self._snapshot_of.popitem(last=False)
        else:
            return -1
        self._pending_snapshots.append((name, slot))
        return slot

    def commit(self) -> None:
        for name, block in self._pending:
            if name not in self._block_of and block not in self._name_of:
                self._block_of[name], self._name_of[block] = block, name
        for name, slot in self._pending_snapshots:
            self._snapshot_of[name] = slot
        self._pending.clear()
        self._pending_snapshots.clear()

    def evict(self) -> int:
        """Take back the least recently used idle cached block; it loses its name."""
        block, _ = self.idle.popitem(last=False)
        self.num_evicted_blocks += 1
        name = self._name_of.pop(block)
        del self._block_of[name]
        snapshot = self._snapshot_of.pop(name, None)  # unreachable without its block
        if snapshot is not None:
            self._free_snapshots.append(snapshot)
        return block


def restore_slot_state(model: Any, cache: Any, slot: int, snapshot_slot: int, token_ids: list[int], start: int) -> None:
    """Before a hit's first step: the slot state at `start`. Exact mode copies the snapshot (every
    window ring, open groups, look-back); bounded mode leaves the rings (the step attends none of
    their rows below `start`) and rebuilds V4.1's engram look-back, which depends only on tokens."""
    if snapshot_slot >= 0:
        cache.copy_sequence(snapshot_slot, slot, [], [])
        return
    hasher = getattr(model, "hasher", None)
    if hasher is None:
        return
    cache.engram_history[slot].copy_(hasher.lookback(token_ids[:start]), non_blocking=True)


class PrefixReuseUnavailable(ValueError):
    """The prefix-caching options ask for something this engine cannot do."""


def prefix_reuse_for(config: EngineConfig, model_config: Any) -> PrefixReuse | None:
    """The engine's prefix reuse from its config (None = off), refusing combinations it cannot serve."""
    options = config.prefix_caching
    if not options.enabled:
        return None
    if config.speculative is not None:
        raise PrefixReuseUnavailable(
            "enable_prefix_caching with speculative decoding: the drafter's state is rebuilt by a full "
            "prefill and is not snapshotted; turn one of them off"
        )
    if options.reuse == "exact":
        cone = 0
        if model_config.model_type == "deepseek_v41":
            text = model_config.text_config
            cone = text.num_hidden_layers * (text.sliding_window - 1)
        return PrefixReuse("exact", 0, options.num_snapshots or config.scheduler.max_num_seqs, cone)
    if model_config.model_type != "deepseek_v41":
        raise PrefixReuseUnavailable(
            f"prefix_reuse='bounded' is DeepSeek-V4.1's replay (its compressor keeps cached entries); "
            f"model_type {model_config.model_type!r} supports prefix_reuse='exact'"
        )
    return PrefixReuse("bounded", options.decoder_replay_span, 0)
