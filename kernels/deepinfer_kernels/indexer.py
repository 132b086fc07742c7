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

The top-k keeps the reference's order: descending score, ties broken towards the lowest entry (a
stable sort). In a decode step, rows of up to `TOPK_IN_KERNEL_WIDTH` entries take one program each,
which sorts 64-bit keys (the score's order-preserving bits, then the entry's complement) in registers:
one launch where torch's sort and its selects took 12 (22 us of sort at batch 1). Other steps, and
wider rows, take torch's sort (the interpreter the tests run through needs ~0.4 s a row for the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["TOPK_IN_KERNEL_WIDTH", "indexer_topk", "indexer_supported", "tile_config"]

# Widest row the top-k kernel sorts in registers (a 32K-token context at ratio 4: 64 KB of keys).
TOPK_IN_KERNEL_WIDTH = 8192
# Entries a tile of the decode score kernel.
_DECODE_BLOCK_W = 64
# -inf's float32 bits (0xFF800000) as the top-k kernel orders them: a negative float's bits flipped but the sign.
_NEG_INF_KEY = -0x00800000 ^ 0x7FFFFFFF


def tile_config(decode_step: bool, batch_invariant: bool) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_W) of the score kernel. From an H200 sweep (BENCHMARKS.md), scores and sort at V4-Flash
    widths: 64 query rows a tile at 8,192 tokens (1.45 -> 0.88 ms, 0.52 of it the sort), 16 at decode
    (64 sequences at 4,096: 0.149 -> 0.119 ms); 128 entries a tile for both. The batch-invariant mode keeps
    16 rows whatever the step: the MMA shape, hence a score's rounding, would otherwise depend on it."""
    return (16 if decode_step or batch_invariant else 64), 128


@triton.jit
def _indexer_scores_kernel(
    q_ptr, hw_ptr, keys_ptr, tables_ptr, n_entries_ptr, pos_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr,
    out_ptr, H, ratio, per_block, stride_table, stride_page, stride_slot, stride_out, head_scale, dim_scale, W_TILES,
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
    visible = (w[None, :] < limit[:, None]) & (w[None, :] < tl.load(n_entries_ptr + seq))
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + w[None, :]
    out_ok = row_ok[:, None] & (w[None, :] < stride_out)
    if first_w < tl.max(limit, axis=0):
        w_ok = w < tl.load(n_entries_ptr + seq)
        page = tl.load(tables_ptr + seq.to(tl.int64) * stride_table + w // per_block, mask=w_ok, other=0)
        dims = tl.arange(0, DI)
        key_rows = page.to(tl.int64) * stride_page + (w % per_block) * stride_slot
        keys = tl.load(keys_ptr + key_rows[:, None] + dims[None, :], mask=w_ok[:, None], other=0.0)
        acc = tl.zeros([BLOCK_Q, BLOCK_W], dtype=tl.float32)
        for h in range(H):
            q = tl.load(q_ptr + (rows.to(tl.int64)[:, None] * H + h) * DI + dims[None, :], mask=row_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(keys))
            weight = tl.load(hw_ptr + rows * H + h, mask=row_ok, other=0.0).to(tl.float32) * head_scale
            acc += (tl.maximum(s, 0.0) * dim_scale) * weight[:, None]
        tl.store(out_ptrs, tl.where(visible, acc, float("-inf")), mask=out_ok)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_Q, BLOCK_W], float("-inf"), tl.float32), mask=out_ok)


@triton.jit
def _decode_scores_kernel(
    q_ptr, hw_ptr, keys_ptr, tables_ptr, n_entries_ptr, pos_ptr, out_ptr, H, ratio, per_block, stride_table,
    stride_page, stride_slot, stride_out, head_scale, dim_scale,
    DI: tl.constexpr, HEADS: tl.constexpr, IEEE: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # program (sequence, entry tile): the sequence's one query row is its index
    seq = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    n_entries = tl.load(n_entries_ptr + seq)
    limit = tl.minimum((tl.load(pos_ptr + seq) + 1) // ratio, n_entries)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_out + w
    if tl.program_id(1) * BLOCK_W < limit:
        w_ok = w < n_entries
        page = tl.load(tables_ptr + seq.to(tl.int64) * stride_table + w // per_block, mask=w_ok, other=0)
        dims, heads = tl.arange(0, DI), tl.arange(0, HEADS)
        key_rows = page.to(tl.int64) * stride_page + (w % per_block) * stride_slot
        keys = tl.load(keys_ptr + key_rows[:, None] + dims[None, :], mask=w_ok[:, None], other=0.0)
        head_ok = heads < H
        q = tl.load(q_ptr + (seq.to(tl.int64) * H + heads[:, None]) * DI + dims[None, :], mask=head_ok[:, None],
                    other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        weight = tl.load(hw_ptr + seq * H + heads, mask=head_ok, other=0.0).to(tl.float32) * head_scale
        score = tl.sum((tl.maximum(s, 0.0) * dim_scale) * weight[:, None], axis=0)
        tl.store(out_ptrs, tl.where(w < limit, score, float("-inf")), mask=w < stride_out)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_W], float("-inf"), tl.float32), mask=w < stride_out)


@triton.jit
def _topk_kernel(
    scores_ptr, out_ptr, width, topk, stride_scores, stride_out,
    WIDTH: tl.constexpr, K: tl.constexpr, NEG_INF_KEY: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # One row: 64-bit keys whose signed order is (score descending, entry ascending), the top K of them by
    # a bitonic top-k, decoded back to entries (-1 where the score is -inf: not visible, or padding).
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, WIDTH)
    score = tl.load(scores_ptr + row * stride_scores + w, mask=w < width, other=float("-inf"))
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes 0.0, which the reference ties with it
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # as signed integers, ordered as the floats
    top = tl.topk((ordered.to(tl.int64) << 32) | (WIDTH - 1 - w).to(tl.int64), K)
    entry = (WIDTH - 1 - top.to(tl.int32)).to(tl.int64)  # the low 32 bits
    j = tl.arange(0, K)
    tl.store(out_ptr + row * stride_out + j, tl.where((top >> 32) > NEG_INF_KEY, entry, -1),
             mask=j < tl.minimum(topk, width))


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
    # entries per sequence on the device; the score width from the host (or the graph's bound)
    n_entries = ((batch.context_lens + batch.query_start_loc[1:] - batch.query_start_loc[:-1]) // ratio).int()
    if batch.max_seq_len is not None:
        width = batch.max_seq_len // ratio
    else:
        width = max((c + n) // ratio for c, n in zip(batch.context_lens_cpu, batch.query_lens_cpu)) if t else 0
    out = torch.full((t, topk), -1, dtype=torch.long, device=device)
    if t == 0 or width == 0:
        return out
    decode_step = all(n == 1 for n in batch.query_lens_cpu)
    scores = torch.empty(t, width, dtype=torch.float32, device=device)
    q, head_weights = q.contiguous(), head_weights.contiguous()
    paging = (index_keys, batch.block_tables, n_entries, batch.positions)
    strides = (index_keys.shape[1], batch.block_tables.stride(0), index_keys.stride(0), index_keys.stride(1), width)
    if decode_step and not batch_invariant:
        _decode_scores_kernel[(t, triton.cdiv(width, _DECODE_BLOCK_W))](
            q, head_weights, *paging, scores, h, ratio, *strides, h ** -0.5, di ** -0.5,
            DI=di, HEADS=max(16, triton.next_power_of_2(h)), IEEE=q.dtype == torch.float32, BLOCK_W=_DECODE_BLOCK_W,
            **launch_options(q.device),
        )
    else:
        block_q, block_w = tile_config(decode_step, batch_invariant)
        tiles = _query_tiles(batch.query_lens_cpu, block_q, decode_step, device)
        w_tiles = triton.cdiv(width, block_w)
        _indexer_scores_kernel[(tiles.shape[1] * w_tiles,)](
            q, head_weights, *paging, tiles[0], tiles[1], tiles[2], scores, h, ratio, *strides,
            h ** -0.5, di ** -0.5, w_tiles, DI=di, IEEE=q.dtype == torch.float32, BLOCK_Q=block_q, BLOCK_W=block_w,
            **launch_options(q.device),
        )
    k = min(topk, width)
    if decode_step and width <= TOPK_IN_KERNEL_WIDTH:
        _topk_kernel[(t,)](
            scores, out, width, topk, scores.stride(0), out.stride(0),
            WIDTH=triton.next_power_of_2(width), K=triton.next_power_of_2(k), NEG_INF_KEY=_NEG_INF_KEY,
            num_warps=4 if width <= 2048 else 8, **launch_options(q.device),
        )
        return out
    ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    out[:, :k] = torch.where(torch.isfinite(ranked[:, :k]), order[:, :k], -1)
    return out
