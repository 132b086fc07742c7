"""Fused RMSNorm over the last dim: one program per row, float32 math, one read and one write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, float32 inside, x.dtype out."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    # NOTE: one row per program keeps the whole row in registers; 8 warps past 2k columns keeps it under 64 regs/thread.
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), d, eps,
        HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4, **launch_options(x.device),
    )
    return out.view(x.shape)
