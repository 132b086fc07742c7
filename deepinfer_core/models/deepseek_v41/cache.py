"""The paged decode state of DeepSeek-V4.1 (MODEL_SPEC_V41 §8), stored in the KV formats of kv_quant.py.

Per slot (fixed size, indexed by `ForwardBatch.slot_ids`):
- `windows[i]` [num_slots, sliding_window] vectors of head_dim for every layer i: the last
  sliding_window K=V vectors, position p at p % sliding_window (the reference keeps sliding_window - 1;
  the extra row is never visible to the next query);
- per band (KV source layer) with ratio r > 1, `open_kv` / `open_gate` [num_slots, r, head_dim] float32:
  raw compressor projections of the group still open after the step, position p at p % r;
- `engram_history` [num_slots, max_ngram_size - 1] int64 (on the device, where the step hashes):
  compressed ids before the step.
Paged (block_size tokens a block, indexed by `ForwardBatch.block_tables`), per band:
- `entries` [num_blocks, block_size // r] vectors of head_dim: compressed entries (post-RoPE), entry w
  at block block_table[(w*r) // block_size], offset ((w*r) % block_size) // r;
- `index_keys` [num_blocks, block_size // r] vectors of index_head_dim likewise.
Window, entries and keys are `StoredTensor`s: fp8 / fp4 codes plus scales with kv_cache_dtype "fp8_fp4"
(890 bytes of global KV per token for the release layout), the model dtype with "bf16". Nothing at or
after a sequence's context_len is read, so a sequence with context_len 0 may take any slot and blocks
without clearing them. `copy_sequence` forks one sequence's state into another (n > 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import DeepseekV41Config
from .kv_quant import KvCacheDtype, StoredTensor, kv_formats

__all__ = ["BandCache", "DeepseekV41Cache"]

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

_OPEN_GROUP_DTYPE = torch.float32  # the reference pools raw projections in float32


@dataclass(slots=True)
class BandCache:
    ratio: int
    entries: StoredTensor
    index_keys: StoredTensor
    open_kv: torch.Tensor | None
    open_gate: torch.Tensor | None


class DeepseekV41Cache:
    def __init__(
        self,
        config: DeepseekV41Config,
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        allocate: Allocate,
        kv_cache_dtype: KvCacheDtype = "fp8_fp4",
    ) -> None:
        c = config.text_config
        multiple = self.block_size_multiple(config)
        if block_size % multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of every band's compress ratio (lcm {multiple})")
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.kv_cache_dtype = kv_cache_dtype
        formats = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype)
        self.windows = [
            StoredTensor(formats.window, (num_slots, c.sliding_window), c.head_dim, dtype, allocate)
            for _ in range(c.num_hidden_layers)
        ]
        self.bands: dict[int, BandCache] = {}
        for source, ratio in c.band_ratios.items():
            paged = (num_blocks, block_size // ratio)
            pooled = ratio > 1
            self.bands[source] = BandCache(
                ratio,
                StoredTensor(formats.entry, paged, c.head_dim, dtype, allocate),
                StoredTensor(formats.index, paged, c.index_head_dim, dtype, allocate),
                allocate((num_slots, ratio, c.head_dim), _OPEN_GROUP_DTYPE) if pooled else None,
                allocate((num_slots, ratio, c.head_dim), _OPEN_GROUP_DTYPE) if pooled else None,
            )
        self.engram_history = allocate((num_slots, c.engram_max_ngram_size - 1), torch.int64).fill_(-1)

    def copy_sequence(self, src_slot: int, dst_slot: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Make sequence dst's state a copy of src's: its slot state (windows, open groups, engram
        look-back) and blocks `src_blocks` into `dst_blocks` (pairwise), codes and scales as stored.
        The engine forks a prefilled prompt into n > 1 completions with it."""
        device = self.windows[0].parts[0].device
        src_rows, dst_rows = torch.tensor([src_blocks, dst_blocks], dtype=torch.long).to(device, non_blocking=True)
        for window in self.windows:
            for part in window.parts:
                part[dst_slot].copy_(part[src_slot])
        for band in self.bands.values():
            for stored in (band.entries, band.index_keys):
                for part in stored.parts:
                    part[dst_rows] = part[src_rows]
            for open_group in (band.open_kv, band.open_gate):
                if open_group is not None:
                    open_group[dst_slot].copy_(open_group[src_slot])
        self.engram_history[dst_slot].copy_(self.engram_history[src_slot])

    @staticmethod
    def block_size_multiple(config: DeepseekV41Config) -> int:
        return math.lcm(1, *config.text_config.band_ratios.values())

    @staticmethod
    def bytes_per_block(
        config: DeepseekV41Config, block_size: int, dtype: torch.dtype, kv_cache_dtype: KvCacheDtype = "fp8_fp4"
    ) -> int:
        c = config.text_config
        formats = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype)
        per_entry = formats.entry.bytes_per_vector(c.head_dim, dtype) + formats.index.bytes_per_vector(c.index_head_dim, dtype)
        return sum((block_size // r) * per_entry for r in c.band_ratios.values())

    @staticmethod
    def bytes_per_slot(config: DeepseekV41Config, dtype: torch.dtype, kv_cache_dtype: KvCacheDtype = "fp8_fp4") -> int:
        """Device bytes of one slot (the engram look-back lives on the host)."""
        c = config.text_config
        window = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype).window.bytes_per_vector(c.head_dim, dtype)
        open_groups = sum(2 * r * c.head_dim for r in c.band_ratios.values() if r > 1)
        return c.num_hidden_layers * c.sliding_window * window + open_groups * _OPEN_GROUP_DTYPE.itemsize
