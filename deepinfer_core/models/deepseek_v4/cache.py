"""The paged decode state of DeepSeek-V4 (MODEL_SPEC §7), one `LayerCache` per main and MTP layer.

Per slot (a sequence's fixed-size state, indexed by `ForwardBatch.slot_ids`):
- `window` [num_slots, sliding_window, head_dim]: the last sliding_window K=V vectors, position p at
  p % sliding_window;
- for compressed layers, `state_kv` / `state_gate` [num_slots, span, P]: raw compressor projections of
  the recent tokens (span = 2*ratio for CSA, whose entries overlap the previous window; ratio for HCA);
  the CSA indexer keeps its own.
Paged (growing with the sequence, indexed by `ForwardBatch.block_tables`, block_size tokens a block):
- `entries` [num_blocks, block_size // ratio, head_dim]: emitted compressed entries; entry w lives in
  block block_table[(w*ratio) // block_size] at offset ((w*ratio) % block_size) // ratio;
- CSA `index_keys` [num_blocks, block_size // ratio, index_head_dim] likewise.
Validity follows from positions: nothing at or after a sequence's context_len is ever read, so a
sequence with context_len 0 may take any slot and blocks without clearing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.model_config import CSA, DeepseekV4Config, LayerSpec

__all__ = ["CompressorState", "LayerCache", "DeepseekV4Cache"]

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(slots=True)
class CompressorState:
    state_kv: torch.Tensor
    state_gate: torch.Tensor
    entries: torch.Tensor


@dataclass(slots=True)
class LayerCache:
    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class DeepseekV4Cache:
    """All layers' decode state; `layers[i]` for main layer i, `layers[num_hidden_layers + j]` for MTP j."""

    def __init__(
        self,
        config: DeepseekV4Config,
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        allocate: Allocate,
    ) -> None:
        multiple = self.block_size_multiple(config)
        if block_size % multiple:
            raise ValueError(
                f"block_size {block_size} must be a multiple of every compress ratio (lcm {multiple})"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.layers = [
            _layer_cache(config, spec, num_blocks, block_size, num_slots, dtype, allocate)
            for spec in config.all_layers
        ]

    @staticmethod
    def block_size_multiple(config: DeepseekV4Config) -> int:
        return math.lcm(1, *config.compress_ratios)

    @staticmethod
    def bytes_per_block(config: DeepseekV4Config, block_size: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for spec in config.all_layers:
            if spec.is_compressed:
                width = config.head_dim + (config.index_head_dim if spec.attention == CSA else 0)
                total += (block_size // spec.compress_ratio) * width
        return total * size

    @staticmethod
    def bytes_per_slot(config: DeepseekV4Config, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for spec in config.all_layers:
            total += config.sliding_window * config.head_dim
            if spec.attention == CSA:
                total += 2 * (2 * spec.compress_ratio) * (2 * config.head_dim + 2 * config.index_head_dim)
            elif spec.is_compressed:
                total += 2 * spec.compress_ratio * config.head_dim
        return total * size

    def copy_sequence(self, src_slot: int, dst_slot: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Make sequence dst's state a copy of src's: its slot state and blocks `src_blocks` into
        `dst_blocks` (pairwise). The engine forks a prefilled prompt into n > 1 completions with it."""
        src_rows, dst_rows = torch.tensor([src_blocks, dst_blocks], dtype=torch.long).to(
            self.layers[0].window.device, non_blocking=True)  # pageable + non_blocking: no stream sync
        for layer in self.layers:
            layer.window[dst_slot].copy_(layer.window[src_slot])
            for state in (layer.compressor, layer.indexer):
                if state is not None:
                    state.state_kv[dst_slot].copy_(state.state_kv[src_slot])
                    state.state_gate[dst_slot].copy_(state.state_gate[src_slot])
                    state.entries[dst_rows] = state.entries[src_rows]


def _layer_cache(
    config: DeepseekV4Config,
    spec: LayerSpec,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    dtype: torch.dtype,
    allocate: Allocate,
) -> LayerCache:
    window = allocate((num_slots, config.sliding_window, config.head_dim), dtype)
    if not spec.is_compressed:
        return LayerCache(window)
    ratio, overlap = spec.compress_ratio, spec.attention == CSA

    def state(width: int) -> CompressorState:
        span, proj = (2 * ratio, 2 * width) if overlap else (ratio, width)
        return CompressorState(
            allocate((num_slots, span, proj), dtype),
            allocate((num_slots, span, proj), dtype),
            allocate((num_blocks, block_size // ratio, width), dtype),
        )

    return LayerCache(window, state(config.head_dim), state(config.index_head_dim) if overlap else None)
