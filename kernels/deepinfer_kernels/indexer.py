"""Lightning-indexer scores over the paged index keys, then the top-k entries per query.

The score kernel tiles (queries of one sequence) x (entries): it gathers the entries' keys through
the block table once per tile and loops over the indexer heads, accumulating
sum_h w[t, h] * ReLU(q[t, h] . K[w]) in float32, so the [T, H, W] per-head scores are never stored.
Tiles whose entries no query of the tile can see only write -inf. Each score is reduced over the
heads in a fixed order for its own row and entry, whatever the batch (batch-invariant).

A decode step (one query a sequence, outside the batch-invariant mode) takes another score kernel: its
program meets all heads of its query with an entry tile in one product ([heads, di] x [di, entries]),
then sums over the heads, where the tiled kernel loops over the heads one product each (at batch 1
that loop was the whole cost: 26 us a layer at 1,024 entries).

The top-k keeps the reference's order: descending score, ties broken towards the lowest entry
(`top_entries`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.step_layout import sequence_end
from deepinfer_kernels.top_entries import top_entries

__all__ = ["indexer_topk", "indexer_supported", "tile_config"]

# Entries a tile of the decode score kernel.
_DECODE_BLOCK_W = 64


def tile_config(batch_invariant: bool) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_W) of the tiled score kernel (prefill and mixed steps; every step in batch-invariant
    mode). From an H200 sweep (BENCHMARKS.md, scores and sort at V4-Flash widths): 64 query rows a tile
    at 8,192 tokens (1.45 -> 0.88 ms, 0.52 of it the sort), 128 entries. The batch-invariant mode keeps 16
    rows whatever the step, the size that suited its decode steps: the MMA shape, hence a score's
    rounding, would otherwise depend on the step."""
    return (16 if batch_invariant else 64), 128


@triton.jit
def _entry_keys(keys_ptr, tables_ptr, seq, w, n_entries, per_block, stride_table, stride_page, stride_slot,
                DI: tl.constexpr):
    """Sequence `seq`'s index keys of entries `w`, [len(w), DI], gathered through its block table (0 past
    its `n_entries`)."""
    w_ok = w < n_entries
    page = tl.load(tables_ptr + seq.to(tl.int64) * stride_table + w // per_block, mask=w_ok, other=0)
    key_rows = page.to(tl.int64) * stride_page + (w % per_block) * stride_slot
    return tl.load(keys_ptr + key_rows[:, None] + tl.arange(0, DI)[None, :], mask=w_ok[:, None], other=0.0)


@triton.jit
def _dot_keys(q, keys, IEEE: tl.constexpr):
    """q [M, DI] . keys [W, DI] -> [M, W] in float32 (IEEE for float32 inputs)."""
    if IEEE:
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(keys))
    return s


@triton.jit
def _indexer_scores_kernel(
    q_ptr, hw_ptr, keys_ptr, tables_ptr, query_start_ptr, context_lens_ptr, pos_ptr, tile_seq_ptr, tile_start_ptr,
    tile_end_ptr, out_ptr, H, stride_hw, ratio, per_block, stride_table, stride_page, stride_slot, stride_out, head_scale,
    dim_scale, W_TILES,
    DI: tl.constexpr, IEEE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # All entry tiles of a query tile, then the next: they run side by side and read the tile's queries
    # (all heads) once from memory. Query tiles first re-read every query once per entry tile.
    tile = tl.program_id(0) // W_TILES
    first_w = (tl.program_id(0) % W_TILES) * BLOCK_W
    seq = tl.load(tile_seq_ptr + tile)
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_Q)
    row_ok = rows < tl.load(tile_end_ptr + tile)
    w = first_w + tl.arange(0, BLOCK_W)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    limit = tl.where(row_ok, (pos + 1) // ratio, 0)
    n_entries = sequence_end(query_start_ptr, context_lens_ptr, seq) // ratio
    visible = (w[None, :] < limit[:, None]) & (w[None, :] < n_entries)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + w[None, :]
    out_ok = row_ok[:, None] & (w[None, :] < stride_out)
    if first_w < tl.max(limit, axis=0):
        keys = _entry_keys(keys_ptr, tables_ptr, seq, w, n_entries, per_block, stride_table, stride_page, stride_slot, DI)
        dims = tl.arange(0, DI)
        acc = tl.zeros([BLOCK_Q, BLOCK_W], dtype=tl.float32)
        for h in range(H):
            q = tl.load(q_ptr + (rows.to(tl.int64)[:, None] * H + h) * DI + dims[None, :], mask=row_ok[:, None], other=0.0)
            s = _dot_keys(q, keys, IEEE)
            weight = tl.load(hw_ptr + rows * stride_hw + h, mask=row_ok, other=0.0).to(tl.float32) * head_scale
            acc += (tl.maximum(s, 0.0) * dim_scale) * weight[:, None]
        tl.store(out_ptrs, tl.where(visible, acc, float("-inf")), mask=out_ok)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_Q, BLOCK_W], float("-inf"), tl.float32), mask=out_ok)


@triton.jit
def _decode_scores_kernel(
    q_ptr, hw_ptr, keys_ptr, tables_ptr, query_start_ptr, context_lens_ptr, pos_ptr, out_ptr, H, stride_hw, ratio, per_block,
    stride_table, stride_page, stride_slot, stride_out, head_scale, dim_scale,
    DI: tl.constexpr, HEADS: tl.constexpr, IEEE: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # program (sequence, entry tile): the sequence's one query row is its index
    seq = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    n_entries = sequence_end(query_start_ptr, context_lens_ptr, seq) // ratio
    limit = tl.minimum((tl.load(pos_ptr + seq) + 1) // ratio, n_entries)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_out + w
    if tl.program_id(1) * BLOCK_W < limit:
        keys = _entry_keys(keys_ptr, tables_ptr, seq, w, n_entries, per_block, stride_table, stride_page, stride_slot, DI)
        heads = tl.arange(0, HEADS)
        head_ok = heads < H
        q = tl.load(q_ptr + (seq.to(tl.int64) * H + heads[:, None]) * DI + tl.arange(0, DI)[None, :],
                    mask=head_ok[:, None], other=0.0)
        s = _dot_keys(q, keys, IEEE)
        weight = tl.load(hw_ptr + seq * stride_hw + heads, mask=head_ok, other=0.0).to(tl.float32) * head_scale
        score = tl.sum((tl.maximum(s, 0.0) * dim_scale) * weight[:, None], axis=0)
        tl.store(out_ptrs, tl.where(w < limit, score, float("-inf")), mask=w < stride_out)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_W], float("-inf"), tl.float32), mask=w < stride_out)


def indexer_supported(q: torch.Tensor, index_keys: torch.Tensor) -> bool:
    di = q.shape[-1]
    return di >= 16 and di & (di - 1) == 0 and index_keys.dtype == q.dtype and q.dtype in (torch.bfloat16, torch.float32)


def _query_tiles(query_lens: list[int], block_q: int, decode_step: bool, device: torch.device) -> torch.Tensor:
    """[3, tiles] int32 (sequence, first row, end row) of every block_q-row query tile. A decode step
    (one row a sequence) builds it on the device, so a captured graph holds no host copy."""
    if decode_step:
        rows = torch.arange(len(query_lens), dtype=torch.int32, device=device)
        return torch.stack([rows, rows, rows + 1])
    tile_seq, tile_start, tile_end, row = [], [], [], 0
    for i, n_q in enumerate(query_lens):
        for first in range(row, row + n_q, block_q):
            tile_seq.append(i)
            tile_start.append(first)
            tile_end.append(row + n_q)
        row += n_q
    return torch.tensor([tile_seq, tile_start, tile_end], dtype=torch.int32).to(device, non_blocking=True)


def indexer_topk(
    q: torch.Tensor, head_weights: torch.Tensor, index_keys: torch.Tensor, ratio: int, topk: int, batch: ForwardBatch,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """`KernelOps.indexer_topk`: int64 [T, topk] visible entries by descending score, -1 padded."""
    t, h, di = q.shape
    device = q.device
    # the score width from the host (or the graph's bound); each sequence's entry count is read in the kernels
    width = batch.seq_len_bound // ratio if t else 0
    if t == 0 or width == 0:
        return torch.full((t, topk), -1, dtype=torch.long, device=device)
    decode_step = all(n == 1 for n in batch.query_lens_cpu)
    scores = torch.empty(t, width, dtype=torch.float32, device=device)
    # head weights may be a column view of a wider projection output (strided rows)
    q = q.contiguous()
    head_weights = head_weights if head_weights.stride(-1) == 1 else head_weights.contiguous()
    paging = (index_keys, batch.block_tables, batch.query_start_loc, batch.context_lens, batch.positions)
    strides = (index_keys.shape[1], batch.block_tables.stride(0), index_keys.stride(0), index_keys.stride(1), width)
    if decode_step and not batch_invariant:
        _decode_scores_kernel[(t, triton.cdiv(width, _DECODE_BLOCK_W))](
            q, head_weights, *paging, scores, h, head_weights.stride(0), ratio, *strides, h ** -0.5, di ** -0.5,
            DI=di, HEADS=max(16, triton.next_power_of_2(h)), IEEE=q.dtype == torch.float32, BLOCK_W=_DECODE_BLOCK_W,
            **launch_options(q.device),
        )
    else:
        block_q, block_w = tile_config(batch_invariant)
        tiles = _query_tiles(batch.query_lens_cpu, block_q, decode_step, device)
        w_tiles = triton.cdiv(width, block_w)
        _indexer_scores_kernel[(tiles.shape[1] * w_tiles,)](
            q, head_weights, *paging, tiles[0], tiles[1], tiles[2], scores, h, head_weights.stride(0), ratio, *strides,
            h ** -0.5, di ** -0.5, w_tiles, DI=di, IEEE=q.dtype == torch.float32, BLOCK_Q=block_q, BLOCK_W=block_w,
            **launch_options(q.device),
        )
    return top_entries(scores, topk)
