"""The row plan of the grouped MoE GEMMs: (token, slot) pairs sorted stably by expert, each expert's run
padded to a multiple of the GEMM's row block. Three launches, no host sync, work linear in the pairs:

1. a program per chunk of pairs counts its pairs per expert (a histogram row of `tally`);
2. one program turns the histogram rows into, per chunk and expert, the pairs of earlier chunks (a
   column scan), then each expert's count and the start and end of its padded run;
3. a program per chunk places its pairs (rank among the chunk's earlier pairs of the same expert, by
   comparing the chunk with itself) and labels its share of the rows: -1 for padding rows, and for each
   row block its expert (a binary search of the run ends) and its run's first block and length in blocks
   (so that the GEMMs can order an expert's tiles, `fused_moe._expert_tile`).

A row's place in its expert's run does not change its GEMM result (each output row reads only its own
input row), but the stable order keeps the plan itself a pure function of the routing.

A step of a few pairs and padded rows (one token at top-6 with the shared expert, decode tiles) takes one
launch instead (`one_launch_plan`): its pairs compared with each other stand in for the histogram, and the
runs stay in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["moe_plan", "one_launch_plan", "plan_rows"]

# Pairs per chunk: a [CHUNK, CHUNK] comparison ranks a chunk's pairs; prefill-sized steps take 128.
_CHUNK, _LARGE_CHUNK, _LARGE_FROM = 64, 128, 4096
# Steps of at most this many pairs and padded rows take one launch (`one_launch_plan`).
_ONE_LAUNCH_PAIRS, _ONE_LAUNCH_ROWS = 8, 128
# Histogram rows scanned per step of launch 2.
_SCAN_ROWS = 16


@triton.jit
def _pair_experts(ids_ptr, local_ids_ptr, offs, valid, NUM_ROUTED, TOP_K, SHARED: tl.constexpr):
    """Stack index of pairs `offs` (NUM_ROUTED + SHARED or more: none). Routed pairs read local_ids
    (NUM_ROUTED = not held); with SHARED, pair (t, TOP_K) of the TOP_K + 1 per token is the shared
    expert's, index NUM_ROUTED, and routed pairs not held move to NUM_ROUTED + 1."""
    if SHARED:
        slot = offs % (TOP_K + 1)
        routed = valid & (slot < TOP_K)
        pair = (offs // (TOP_K + 1)) * TOP_K + slot
        local = tl.load(local_ids_ptr + tl.load(ids_ptr + pair, mask=routed, other=0), mask=routed, other=NUM_ROUTED)
        local = tl.where(local >= NUM_ROUTED, NUM_ROUTED + 1, local)
        return tl.where(valid & (slot == TOP_K), NUM_ROUTED, local)
    else:
        return tl.load(local_ids_ptr + tl.load(ids_ptr + offs, mask=valid, other=0), mask=valid, other=NUM_ROUTED)


@triton.jit
def _histogram_kernel(
    ids_ptr, local_ids_ptr, tally_ptr, PAIRS, NUM_ROUTED, TOP_K,
    CHUNK: tl.constexpr, BINS: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < PAIRS
    local = _pair_experts(ids_ptr, local_ids_ptr, offs, valid, NUM_ROUTED, TOP_K, SHARED)
    held = valid & (local < NUM_ROUTED + SHARED)
    counts = tl.histogram(tl.where(held, local, 0).to(tl.int32), BINS, mask=held)
    tl.store(tally_ptr + chunk * BINS + tl.arange(0, BINS), counts)


@triton.jit
def _scan_kernel(
    tally_ptr, NUM_CHUNKS, BLOCK_M: tl.constexpr, BINS: tl.constexpr, SCAN_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # Rows 0..NUM_CHUNKS-1 become exclusive prefixes over chunks; then run start, count, run end.
    bins = tl.arange(0, BINS)
    seen = tl.zeros((BINS,), dtype=tl.int32)
    for first in range(0, NUM_CHUNKS, SCAN_ROWS):
        rows = first + tl.arange(0, SCAN_ROWS)
        at = tally_ptr + rows[:, None] * BINS + bins[None, :]
        ok = (rows < NUM_CHUNKS)[:, None]
        counts = tl.load(at, mask=ok, other=0)
        tl.store(at, tl.cumsum(counts, 0) - counts + seen[None, :], mask=ok)
        seen += tl.sum(counts, 0)
    padded = (seen + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, 0) - padded
    tl.store(tally_ptr + NUM_CHUNKS * BINS + bins, start)
    tl.store(tally_ptr + (NUM_CHUNKS + 1) * BINS + bins, seen)
    tl.store(tally_ptr + (NUM_CHUNKS + 2) * BINS + bins, start + padded)


@triton.jit
def _place_kernel(
    ids_ptr, local_ids_ptr, tally_ptr, row_entry_ptr, blocks_ptr, PAIRS, NUM_ROUTED, TOP_K, ROWS,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr, LOG2_BINS: tl.constexpr, SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    pid = tl.program_id(0)
    num_held = NUM_ROUTED + SHARED
    num_chunks = tl.cdiv(PAIRS, CHUNK)
    run_start = tally_ptr + num_chunks * BINS
    count = tally_ptr + (num_chunks + 1) * BINS
    run_end = tally_ptr + (num_chunks + 2) * BINS
    lanes = tl.arange(0, CHUNK)
    if pid < num_chunks:
        offs = pid * CHUNK + lanes
        valid = offs < PAIRS
        local = _pair_experts(ids_ptr, local_ids_ptr, offs, valid, NUM_ROUTED, TOP_K, SHARED)
        held = valid & (local < num_held)
        earlier = (local[:, None] == local[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        expert = tl.where(held, local, 0)
        dest = tl.load(run_start + expert) + tl.load(tally_ptr + pid * BINS + expert) + rank
        tl.store(row_entry_ptr + dest, offs.to(tl.int32), mask=held)
    rows = pid * CHUNK + lanes
    in_range = rows < ROWS
    # the expert whose padded run holds the row: the first with run_end > row (run ends never decrease)
    lo = tl.zeros((CHUNK,), dtype=tl.int32)
    hi = tl.full((CHUNK,), BINS, tl.int32)
    for _ in tl.static_range(LOG2_BINS + 1):
        mid = (lo + hi) // 2
        right = (mid < hi) & (tl.load(run_end + tl.minimum(mid, BINS - 1)) <= rows)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    expert = tl.minimum(lo, num_held)
    owned = expert < num_held
    first_row = tl.load(run_start + expert, mask=owned, other=0)
    filled_end = first_row + tl.load(count + expert, mask=owned, other=0)
    padding = ~owned | (rows >= filled_end)
    tl.store(row_entry_ptr + rows, tl.full((CHUNK,), -1, tl.int32), mask=in_range & padding)
    _store_blocks(blocks_ptr, rows, in_range, expert, owned, first_row, tl.load(run_end + expert, mask=owned, other=0),
                  BLOCK_M)


@triton.jit
def _store_blocks(blocks_ptr, rows, in_range, expert, owned, first_row, end_row, BLOCK_M: tl.constexpr):
    """The plan's `blocks` row of each row block that starts among `rows`: (expert, its run's first block, the
    run's blocks), or (past the end, the block itself, 1) for a block no run holds."""
    block = rows // BLOCK_M
    first = tl.where(owned, first_row // BLOCK_M, block)
    length = tl.where(owned, (end_row - first_row) // BLOCK_M, 1)
    starts = in_range & (rows % BLOCK_M == 0)
    tl.store(blocks_ptr + 3 * block, expert, mask=starts)
    tl.store(blocks_ptr + 3 * block + 1, first, mask=starts)
    tl.store(blocks_ptr + 3 * block + 2, length, mask=starts)


@triton.jit
def _one_launch_plan_kernel(
    ids_ptr, local_ids_ptr, row_entry_ptr, blocks_ptr, PAIRS, NUM_ROUTED, TOP_K, ROWS,
    BLOCK_M: tl.constexpr, PAIRS_P2: tl.constexpr, ROW_TILE: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # The three launches' plan for PAIRS <= PAIRS_P2 and ROWS <= ROW_TILE. Each held expert's run is represented
    # by its first pair: the run's length is that expert's count of pairs, its start the padded runs of the
    # lower experts.
    num_held = NUM_ROUTED + SHARED
    lanes = tl.arange(0, PAIRS_P2)
    valid = lanes < PAIRS
    local = _pair_experts(ids_ptr, local_ids_ptr, lanes, valid, NUM_ROUTED, TOP_K, SHARED)
    held = valid & (local < num_held)
    same = (local[:, None] == local[None, :]) & held[:, None] & held[None, :]
    count = tl.sum(same.to(tl.int32), 1)
    rank = tl.sum((same & (lanes[None, :] < lanes[:, None])).to(tl.int32), 1)
    first = held & (rank == 0)
    padded = tl.where(first, (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(first[None, :] & (local[None, :] < local[:, None]), padded[None, :], 0), 1)
    tl.store(row_entry_ptr + start + rank, lanes, mask=held)
    rows = tl.arange(0, ROW_TILE)
    in_range = rows < ROWS
    # [rows, pairs]: which run (first pair) holds each row, and whether a pair fills it
    in_run = first[None, :] & (start[None, :] <= rows[:, None]) & (rows[:, None] < (start + padded)[None, :])
    filled = tl.sum((in_run & (rows[:, None] < (start + count)[None, :])).to(tl.int32), 1) > 0
    tl.store(row_entry_ptr + rows, tl.full((ROW_TILE,), -1, tl.int32), mask=in_range & ~filled)
    owned = tl.sum(in_run.to(tl.int32), 1) > 0
    expert = tl.where(owned, tl.sum(tl.where(in_run, local[None, :], 0), 1), num_held)
    first_row = tl.sum(tl.where(in_run, start[None, :], 0), 1)
    end_row = first_row + tl.sum(tl.where(in_run, padded[None, :], 0), 1)
    _store_blocks(blocks_ptr, rows, in_range, expert, owned, first_row, end_row, BLOCK_M)


def plan_rows(pairs: int, num_held: int, block_m: int) -> int:
    """Padded rows of a plan: every pair in its own expert's run, each run padded to block_m (the worst case)."""
    return triton.cdiv(pairs + min(num_held, pairs) * (block_m - 1), block_m) * block_m


def one_launch_plan(pairs: int, rows: int) -> bool:
    """Whether a plan of `pairs` pairs and `rows` padded rows takes `_one_launch_plan_kernel` (one program, one
    warp, [rows, pairs] comparisons) instead of the three launches. H200, graph replay: a token at top-6 with
    the shared expert 7.6 -> 2.2 us with 8-row blocks, and the batch-1 decode step of the 4-layer V4-Flash
    slice 1.216 -> 1.203 ms in bf16, 1.060 -> 1.039 with fp4 experts. Slower past it: 2 tokens (14 pairs) 8.0
    -> 9.7 us, one token in 64-row blocks (448 rows) 8.0 -> 12.8 (BENCHMARKS.md)."""
    return pairs <= _ONE_LAUNCH_PAIRS and rows <= _ONE_LAUNCH_ROWS


def moe_plan(ids: torch.Tensor, local_ids: torch.Tensor, num_routed: int, block_m: int, shared: bool = False):
    """(row_entry [R] int32: the pair of each padded row or -1, blocks [R / block_m, 3] int32: each row block's
    expert's stack index (num_routed + shared past the end), its run's first row block and the run's length in
    row blocks) for routing ids [T, k] and local_ids [E]
    (an expert's stack index, num_routed when not held). A pair is token * k + slot, or with `shared`
    token * (k + 1) + slot, slot k being the shared expert's (stack index num_routed). Pairs of experts not
    held are dropped. R is fixed by the shapes (every pair in its own expert's run, worst case).
    """
    tokens, top_k = ids.shape
    pairs, num_held = tokens * (top_k + shared), num_routed + shared
    rows = plan_rows(pairs, num_held, block_m)
    row_entry = torch.empty(rows, dtype=torch.int32, device=ids.device)
    blocks = torch.empty((rows // block_m, 3), dtype=torch.int32, device=ids.device)
    if pairs == 0:
        return row_entry, blocks
    flat_ids = ids.reshape(-1)
    if one_launch_plan(pairs, rows):
        _one_launch_plan_kernel[(1,)](
            flat_ids, local_ids, row_entry, blocks, pairs, num_routed, top_k, rows,
            BLOCK_M=block_m, PAIRS_P2=_ONE_LAUNCH_PAIRS, ROW_TILE=triton.next_power_of_2(rows), SHARED=shared,
            num_warps=1, **launch_options(ids.device),
        )
        return row_entry, blocks
    chunk = _LARGE_CHUNK if pairs > _LARGE_FROM else _CHUNK
    bins = max(16, triton.next_power_of_2(num_held))
    num_chunks = triton.cdiv(pairs, chunk)
    tally = torch.empty((num_chunks + 3, bins), dtype=torch.int32, device=ids.device)
    _histogram_kernel[(num_chunks,)](
        flat_ids, local_ids, tally, pairs, num_routed, top_k, CHUNK=chunk, BINS=bins, SHARED=shared,
        **launch_options(ids.device),
    )
    _scan_kernel[(1,)](
        tally, num_chunks, BLOCK_M=block_m, BINS=bins, SCAN_ROWS=_SCAN_ROWS, num_warps=8, **launch_options(ids.device)
    )
    _place_kernel[(max(num_chunks, triton.cdiv(rows, chunk)),)](
        flat_ids, local_ids, tally, row_entry, blocks, pairs, num_routed, top_k, rows,
        BLOCK_M=block_m, CHUNK=chunk, BINS=bins, LOG2_BINS=bins.bit_length() - 1, SHARED=shared,
        num_warps=8 if chunk > 64 else 4, **launch_options(ids.device),
    )
    return row_entry, blocks
