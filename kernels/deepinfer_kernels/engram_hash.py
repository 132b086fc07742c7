"""DeepSeek-V4.1's Engram hash ids (`KernelOps.ngram_hash`) in one launch: a program per block of rows walks
the N shifts once, padding from each row's first DEAD shift on and folding the shift's product into the
rolling XOR of every (layer, head) column, which it reduces mod the column's prime as each n-gram completes.
The reference composes it of 14 torch ops (5 to pad, 9 to hash the release's 4-grams), a launch or more each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["ngram_hash"]

TILE = 512  # rows x (layer, head) columns a program holds: 32 rows of the release's 2 layers x 8 heads


@triton.jit
def _ngram_hash_kernel(
    tokens_ptr, multipliers_ptr, primes_ptr, offsets_ptr, out_ptr, q, pad_id, stride_tq, stride_ts,
    N: tl.constexpr, H: tl.constexpr, LH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_LH: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < q
    cols = tl.arange(0, BLOCK_LH)  # column l * H + h: layer l, head h
    col_ok = cols < LH
    layer, head = cols // H, cols % H
    ok = row_ok[:, None] & col_ok[None, :]
    dead = rows < 0  # no row is dead before its first shift
    rolling = tl.zeros([BLOCK_ROWS, BLOCK_LH], dtype=tl.int64)
    for s in tl.static_range(N):
        token = tl.load(tokens_ptr + rows * stride_tq + s * stride_ts, mask=row_ok, other=0)
        dead = dead | (token == -1)
        token = tl.where(dead, pad_id, token)
        multiplier = tl.load(multipliers_ptr + layer * N + s, mask=col_ok, other=0)
        rolling = rolling ^ (token[:, None] * multiplier[None, :])
        if s > 0:
            # the n-gram of length s+1: primes [L, N-1, H], offsets [L, (N-1)*H] and a row of the output
            # [L, (N-1)*H] share this index
            at = (layer * (N - 1) + s - 1) * H + head
            prime = tl.load(primes_ptr + at, mask=col_ok, other=1)
            offset = tl.load(offsets_ptr + at, mask=col_ok, other=0)
            ids = rolling % prime[None, :] + offset[None, :]
            tl.store(out_ptr + rows[:, None] * ((N - 1) * LH) + at[None, :], ids, mask=ok)


def ngram_hash(
    tokens: torch.Tensor, pad_id: int, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """`KernelOps.ngram_hash`: tokens int64 [q, N] (any strides); multipliers [L, N], primes [L, N-1, H],
    offsets [L, (N-1)*H] int64 -> int64 [q, L, (N-1)*H]."""
    q, n = tokens.shape
    layers, _, heads = primes.shape
    out = torch.empty(q, layers, (n - 1) * heads, dtype=torch.int64, device=tokens.device)
    if q:
        block_lh = triton.next_power_of_2(layers * heads)
        block_rows = max(1, TILE // block_lh)
        _ngram_hash_kernel[(triton.cdiv(q, block_rows),)](
            tokens, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, q, pad_id,
            tokens.stride(0), tokens.stride(1), N=n, H=heads, LH=layers * heads, BLOCK_ROWS=block_rows,
            BLOCK_LH=block_lh, num_warps=4, **launch_options(tokens.device),
        )
    return out
