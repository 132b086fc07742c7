"""Each row's entries of its k highest scores (`KernelOps.top_entries`), in the reference's order: descending
score, ties to the lowest entry (a stable sort), -1 for a -inf score.

Steps of few rows and entries (decode) rank: an entry's place is the number of entries ahead of it, counted
against the whole row, and entries placed inside the top-k write themselves there. One launch of many programs,
where torch's sort and its selects took 12 and one program a row. A bitonic top-k in Triton (`tl.topk` on 64-bit
keys) took 20-45 us a row; unique 64-bit keys (score bits, then the entry) through torch's top-k or its unstable sort
took 3.0x / 2.6x the time of torch's stable sort (H100, 8,192 x 2,048 scores: 1,741 / 1,493 against 573 us).

Larger steps select, a program a row: each score becomes an int32 key in the same order (`_ordered`); a binary
search over the keys' range finds the k-th highest key v (32 counts over the row, the row's first BLOCK_W keys held
in registers); the entries above v and the first of those equal to v (by entry) are the k picked, written as
64-bit (key, entry) composites into the row's own k output slots; those are read back and sorted (k of them, not
the row), then replaced by their entries. The same ids as torch's stable sort of the whole row, which this replaces
(H100: 8,192 x 2,048 scores 590 -> 345 us, 32,768 x 8,192 20.9 -> 3.8 ms; V4's W8A8 prefill of one 32,768-token
sequence 200 -> 167-170 ms a step; BENCHMARKS.md). Finding v a radix digit at a time instead (`tl.histogram`
of each 8-bit digit: 4 passes over the row in place of 33 counts; 4-bit digits too) gave the same ids, and with
8-bit digits a slower step: 179.6 against 171.5 ms for that sequence, one run each on one H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["select_tiles", "top_entries"]

# The rank kernel compares every entry of a row with every other: steps of up to this many comparisons take it,
# larger ones the selection. H100, us: 13.1 against the selection's 17.3 at 1 row of 2,048 entries, 26.8 against
# 19.6 at 16 rows, 88.5 against 20.3 at 64 (BENCHMARKS.md). (Entries ranked a program, compared an iteration: the
# best of seven tiles on an H200.)
_RANK_COMPARISONS = 1 << 25
_RANK_BLOCK_E, _RANK_BLOCK_C = 16, 256
# The selection's resident keys a row (longer rows stream the rest from memory in each count). A resident row takes
# 4 warps, a streamed one 8. H100, us at 4 / 8 warps: 8,192 x 2,048 345.6 / 402.5, 16,384 x 4,096 1,272 / 1,236,
# 32,768 x 8,192 3,835 / 5,353, 8,192 x 16,384 (streamed) 4,366 / 3,638 (BENCHMARKS.md).
_SELECT_MAX_BLOCK = 8192


@triton.jit
def _rank_kernel(
    scores_ptr, out_ptr, width, topk, stride_scores, stride_out,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # An entry's place in the reference's order (score descending, ties to the lowest entry) is the count
    # of entries before it; those that land inside the top-k write their id there (-1 for -inf scores).
    row = tl.program_id(0).to(tl.int64)
    mine = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    score = tl.load(scores_ptr + row * stride_scores + mine, mask=mine < width, other=float("-inf"))
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, width, BLOCK_C):
        other = c0 + tl.arange(0, BLOCK_C)
        s = tl.load(scores_ptr + row * stride_scores + other, mask=other < width, other=float("-inf"))
        ahead = (s[None, :] > score[:, None]) | ((s[None, :] == score[:, None]) & (other[None, :] < mine[:, None]))
        before += tl.sum(ahead.to(tl.int32), axis=1)
    picked = tl.where(score > float("-inf"), mine.to(tl.int64), -1)
    tl.store(out_ptr + row * stride_out + before, picked, mask=(mine < width) & (before < topk))


@triton.jit
def _ordered(scores):
    """float32 scores as int32 keys in the same order under a signed compare: the bits, the lower 31 flipped for a
    negative score; -0.0 as +0.0 (equal scores, equal keys), every NaN the highest key (torch's sort puts NaN first)."""
    bits = scores.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(scores != scores, 2147483647, keys)


@triton.jit
def _row_keys(scores, c0, width, BLOCK_W: tl.constexpr):
    """(keys, entries, entries < width) of the row's entries c0 .. c0 + BLOCK_W."""
    entries = c0 + tl.arange(0, BLOCK_W)
    seen = entries < width
    return _ordered(tl.load(scores + entries, mask=seen, other=0.0)), entries, seen


@triton.jit
def _count_at_least(first, first_seen, scores, width, key, BLOCK_W: tl.constexpr):
    """How many of the row's keys are >= key (int32): the resident first block's, then the rest's from memory."""
    count = tl.sum((first_seen & (first >= key)).to(tl.int32), axis=0)
    for c0 in range(BLOCK_W, width, BLOCK_W):
        keys, _, seen = _row_keys(scores, c0, width, BLOCK_W)
        count += tl.sum((seen & (keys >= key)).to(tl.int32), axis=0)
    return count


@triton.jit
def _pick(keys, entries, seen, v, need, ties, taken, slots):
    """Write the composites of the block's picked entries (keys above v, and keys equal to v while fewer than
    `need` were met before, in entry order) to slots taken.. ; returns (ties, taken) counted on."""
    tie = seen & (keys == v)
    tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
    picked = seen & ((keys > v) | (tie & (tie_rank < need)))
    slot = taken + tl.cumsum(picked.to(tl.int32), axis=0) - 1
    # (key, then the lower entry) as one signed 64-bit order
    composite = (keys.to(tl.int64) << 32) | (2147483647 - entries).to(tl.int64)
    tl.store(slots + slot, composite, mask=picked)
    return ties + tl.sum(tie.to(tl.int32), axis=0), taken + tl.sum(picked.to(tl.int32), axis=0)


@triton.jit
def _select_kernel(
    scores_ptr, out_ptr, width, topk, stride_scores, stride_out,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    scores = scores_ptr + row * stride_scores
    out = out_ptr + row * stride_out
    first, first_entries, first_seen = _row_keys(scores, 0, width, BLOCK_W)
    # The k-th highest key v: the largest with at least topk keys >= it (the lowest key when the row has fewer).
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        enough = _count_at_least(first, first_seen, scores, width, mid.to(tl.int32), BLOCK_W) >= topk
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    v = lo.to(tl.int32)
    above = tl.where(v == 2147483647, 0,
                     _count_at_least(first, first_seen, scores, width, (lo + 1).to(tl.int32), BLOCK_W))
    need = topk - above
    # The picked composites go to this row's own output slots (at most topk of them), sorted after.
    ties, taken = _pick(first, first_entries, first_seen, v, need, 0, 0, out)
    for c0 in range(BLOCK_W, width, BLOCK_W):
        keys, entries, seen = _row_keys(scores, c0, width, BLOCK_W)
        ties, taken = _pick(keys, entries, seen, v, need, ties, taken, out)
    tl.debug_barrier()  # every thread's composites are stored before any thread reads them back
    j = tl.arange(0, BLOCK_K)
    composites = tl.sort(tl.load(out + j, mask=j < taken, other=-9223372036854775808), descending=True)
    keys = (composites >> 32).to(tl.int32)
    entries = 2147483647 - (composites & 0xFFFFFFFF)
    # not -inf (its key: 0xFF800000 with the lower 31 bits flipped), nor NaN: the reference's `> -inf`
    picked = (j < taken) & (keys > -2139095041) & (keys < 2147483647)
    tl.debug_barrier()  # every composite is read before the entries overwrite them
    tl.store(out + j, tl.where(picked, entries, -1), mask=j < topk)


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`KernelOps.top_entries`: int64 [T, k], each row's entries of the k highest scores by descending score, ties
    to the lowest entry, -1 for a -inf score (and past the row's width). Every entry's rank in one launch while
    T x width^2 comparisons stay small (a decode step), else the selection (a program a row)."""
    t, width = scores.shape
    if t == 0 or width == 0:
        return torch.full((t, k), -1, dtype=torch.long, device=scores.device)
    scores = scores.float().contiguous()  # already so in the models: no copy
    out = torch.empty((t, k), dtype=torch.long, device=scores.device)
    if t * width * width <= _RANK_COMPARISONS:
        if width < k:  # it writes every slot below the width: only a row narrower than k needs its tail filled first
            out.fill_(-1)
        _rank_kernel[(t, triton.cdiv(width, _RANK_BLOCK_E))](
            scores, out, width, k, scores.stride(0), out.stride(0), BLOCK_E=_RANK_BLOCK_E, BLOCK_C=_RANK_BLOCK_C,
            **launch_options(scores.device),
        )
        return out
    block_w, warps = select_tiles(width)
    _select_kernel[(t,)](
        scores, out, width, k, scores.stride(0), out.stride(0), BLOCK_W=block_w, BLOCK_K=triton.next_power_of_2(k),
        num_warps=warps, **launch_options(scores.device),
    )
    return out


def select_tiles(width: int) -> tuple[int, int]:
    """(BLOCK_W, warps) of the selection for rows of `width` entries: the whole row resident up to
    `_SELECT_MAX_BLOCK` on 4 warps, longer rows streamed past that block on 8."""
    block_w = min(triton.next_power_of_2(width), _SELECT_MAX_BLOCK)
    return block_w, 8 if width > block_w else 4
