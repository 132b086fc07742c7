"""DeepSeek-V4.1's lightning-indexer scores (`KernelOps.indexer_scores`) in one launch.

The reference materialises the per-head products [S, H, N] in float32 and passes over them four times
(the product, ReLU, the scale, the head weights, the sum), after copying queries and keys to float32: at
a decode step of 64 sequences and 2,048 entries a sequence that is 33 MB a pass, per index source. Here a
program meets one query row's heads with a tile of its keys ([H, di] x [di, tile], float32 accumulation)
and sums over the heads in registers, so only the scores [S, N] are written. Keys are per query row
([S, N, di], a decode step) or shared by all rows ([N, di], one sequence's prefill). With `visible`, the
entries a row cannot see score -inf in the same pass (the model masked them with three more launches).

Rounding: the products of bfloat16 values are exact in float32 (and V4.1's fp4 queries and keys are exact
in bfloat16); what differs from the reference is the order of the float32 sums, over di and over the
heads, within the op's 1e-5 relative tolerance. float32 inputs take IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["indexer_scores", "indexer_scores_supported"]

# Entries a program: the [heads, tile] products of 64 heads stay in a warp group's registers.
BLOCK_N = 64


def indexer_scores_supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Index head dims the MMA tiles (powers of two >= 16), queries and keys of one floating dtype."""
    di = q.shape[-1]
    return di >= 16 and di & (di - 1) == 0 and q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float32)


@triton.jit
def _scores_kernel(
    q_ptr, keys_ptr, hw_ptr, visible_ptr, out_ptr, N, H, stride_qs, stride_qh, stride_ks, stride_kn, stride_hw,
    head_scale, dim_scale, HEADS: tl.constexpr, DI: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
    MASKED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, DI)
    q = tl.load(q_ptr + row * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=heads[:, None] < H, other=0.0)
    keys = tl.load(keys_ptr + row * stride_ks + n.to(tl.int64)[:, None] * stride_kn + dims[None, :],
                   mask=n[:, None] < N, other=0.0)
    if IEEE:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))
    weights = tl.load(hw_ptr + row * stride_hw + heads, mask=heads < H, other=0.0).to(tl.float32) * head_scale
    scores = tl.sum((tl.maximum(dots, 0.0) * dim_scale) * weights[:, None], axis=0)
    if MASKED:  # entries past the query's visible count
        scores = tl.where(n < tl.load(visible_ptr + row), scores, float("-inf"))
    tl.store(out_ptr + row * N + n, scores, mask=n < N)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor | None = None
) -> torch.Tensor:
    """q [S, H, di]; keys [S, N, di] (per row) or [N, di] (shared); head_weights [S, H]; visible [S] (optional:
    -inf past it) -> [S, N] float32."""
    rows, n_heads, di = q.shape
    per_row = keys.dim() == 3
    n_entries = keys.shape[-2]
    out = torch.empty((rows, n_entries), dtype=torch.float32, device=q.device)
    if rows == 0 or n_entries == 0:
        return out
    q, keys, head_weights = q.contiguous(), keys.contiguous(), head_weights.contiguous()
    _scores_kernel[(rows, triton.cdiv(n_entries, BLOCK_N))](
        q, keys, head_weights, out if visible is None else visible.contiguous(), out, n_entries, n_heads,
        q.stride(0), q.stride(1), keys.stride(0) if per_row else 0, keys.stride(-2), head_weights.stride(0),
        n_heads**-0.5, di**-0.5,
        HEADS=max(16, triton.next_power_of_2(n_heads)), DI=di, BLOCK=BLOCK_N, IEEE=q.dtype == torch.float32,
        MASKED=visible is not None, **launch_options(q.device),
    )
    return out
