"""What the layers of one band hand each other within a forward (MODEL_SPEC_V41 §2), and paged access.

The KV source opens a band: its cache holds the band's compressed entries and indexer keys. Index
sources publish `selected` (per-token entry ids, -1 = none) that the following Reuse layers attend;
the candidate source publishes each sequence's candidate-entry mask for the index sources after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

from .cache import BandCache
from .kv_quant import StoredTensor

__all__ = ["DECODE_ROWS", "BandState", "gather_entries", "picked_entries", "write_entries"]

# `BandState.candidates` key of a plain decode step's masks: one row a sequence, all sequences at once.
DECODE_ROWS = -1


@dataclass(slots=True)
class BandState:
    source: int
    cache: BandCache
    selected: torch.Tensor | None = None
    # sequence index -> its queries' candidate masks [q, n_entries]; DECODE_ROWS -> [S, bound entries]
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    # A plain decode step's decoded reads, shared by the band's layers: every index key [S, n, c], and the
    # latest selection's entries with the tables that find them (`picked_entries`).
    index_keys: torch.Tensor | None = None
    picked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def gather_entries(ops: KernelOps, pool: StoredTensor, block_tables: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Entries 0..n_entries-1 from a paged [num_blocks, block_size // ratio] pool, decoded: of one sequence
    for a block table [width], [n_entries, c]; of each sequence for block tables [S, width], [S, n_entries, c]."""
    tables = block_tables.reshape(-1, block_tables.shape[-1])
    ids = torch.arange(n_entries, device=block_tables.device).expand(tables.shape[0], n_entries)
    rows = ops.paged_rows(tables, ids, pool.parts[0].shape[1])
    return pool.read_rows(ops, rows.view(*block_tables.shape[:-1], n_entries))


def picked_entries(ops: KernelOps, band: BandState, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain decode step's selected entries alone, decoded: [S*k + 1, 1, c] (the last row zeros) and block
    tables [S, n + 1] (n: the bound's entry count) that send entry w of sequence s to its row, one entry a
    block, every unselected entry to the zero row. The attention reads the very values it would read from
    the whole decoded pool; the step decodes k entries a sequence instead of all of them."""
    selected = band.selected
    if band.picked is not None and band.picked[0] is selected:  # a Reuse layer of the same selection
        return band.picked[1:]
    pool = band.cache.entries
    # a -1 pick reads entry 0, which no table sends the attention to
    values = pool.read_rows(ops, ops.paged_rows(batch.block_tables, selected, pool.parts[0].shape[1])).flatten(0, 1)
    entries = torch.cat([values, values.new_zeros(1, values.shape[-1])]).unsqueeze(1)
    tables = ops.selection_tables(selected, batch.seq_len_bound // band.cache.ratio)
    band.picked = (selected, entries, tables)
    return entries, tables


def write_entries(
    ops: KernelOps, batch: ForwardBatch, seq_index: torch.Tensor, entry_ids: torch.Tensor,
    *writes: tuple[StoredTensor, torch.Tensor],
) -> None:
    """For each (pool, values) of `writes`, store values[g] as entry entry_ids[g] of sequence seq_index[g]. The
    pools are paged alike ([num_blocks, per_block] vectors): the entries' vector ids are found once."""
    pool = writes[0][0]
    if any(other.parts[0].shape[:-1] != pool.parts[0].shape[:-1] for other, _ in writes):
        raise ValueError("write_entries' pools must share their paging (leading dims)")
    rows = ops.paged_rows(batch.block_tables[seq_index], entry_ids.unsqueeze(1), pool.parts[0].shape[1]).squeeze(1)
    for target, values in writes:
        target.write_rows(ops, rows, values)
