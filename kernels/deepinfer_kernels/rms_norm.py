"""Fused RMSNorm over the last dim: one program per row, float32 math, one read and one write; and the
attention's two latent norms (the query's, and the KV vector's followed by its RoPE) in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.rope import rotate_tile

__all__ = ["latent_norms", "rms_norm"]


@triton.jit
def _normed_row(x_ptr, w_ptr, row, stride_x, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Row `row` of x times rsqrt(mean(x^2) + eps) (times the weight), float32 [BLOCK], zero past D."""
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = _normed_row(x_ptr, w_ptr, row, stride_x, D, eps, HAS_WEIGHT, BLOCK)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < D)


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


@triton.jit
def _latent_norms_kernel(
    q_ptr, q_w_ptr, q_out_ptr, kv_ptr, kv_w_ptr, kv_out_ptr, pos_ptr, freq_ptr, stride_q, stride_kv, DQ, DKV, eps,
    HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
):
    # Program (t, 0) normalises the query's latent row t, program (t, 1) the KV row t and rotates it: the
    # rounded norm, then `rope`'s arithmetic on it (`rotate_tile`), as the two separate launches compute.
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    # (the branches name their values apart: compiled Triton merges same-named values of an if's branches)
    if tl.program_id(1) == 0:
        q_cols = tl.arange(0, BLOCK_Q)
        q = _normed_row(q_ptr, q_w_ptr, row, stride_q, DQ, eps, True, BLOCK_Q)
        tl.store(q_out_ptr + row * DQ + q_cols, q.to(q_out_ptr.dtype.element_ty), mask=q_cols < DQ)
    else:
        kv_cols = tl.arange(0, BLOCK_KV)
        kv = _normed_row(kv_ptr, kv_w_ptr, row, stride_kv, DKV, eps, True, BLOCK_KV).to(kv_out_ptr.dtype.element_ty)
        rotated = rotate_tile(kv[None, :], tl.load(pos_ptr + row), freq_ptr, DKV, HALF, 1.0, BLOCK_KV)
        tl.store(kv_out_ptr + row * DKV + kv_cols[None, :], rotated, mask=kv_cols[None, :] < DKV)


def latent_norms(
    q_lora: torch.Tensor, q_weight: torch.Tensor, kv_latent: torch.Tensor, kv_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KernelOps.latent_norms` in one launch: q_lora [T, dq], kv_latent [T, dkv] (rows may be strided, as
    column views of one projection's output), inv_freq [r/2] float32 with r/2 a power of two."""
    (tokens, dq), dkv = q_lora.shape, kv_latent.shape[1]
    q_lora = q_lora if q_lora.stride(-1) == 1 else q_lora.contiguous()
    kv_latent = kv_latent if kv_latent.stride(-1) == 1 else kv_latent.contiguous()
    q_latent = torch.empty((tokens, dq), dtype=q_lora.dtype, device=q_lora.device)
    kv = torch.empty((tokens, dkv), dtype=kv_latent.dtype, device=kv_latent.device)
    if tokens:
        _latent_norms_kernel[(tokens, 2)](
            q_lora, q_weight, q_latent, kv_latent, kv_weight, kv, positions.contiguous(),
            inv_freq.float().contiguous(), q_lora.stride(0), kv_latent.stride(0), dq, dkv, eps,
            HALF=inv_freq.shape[0], BLOCK_Q=triton.next_power_of_2(dq), BLOCK_KV=triton.next_power_of_2(dkv),
            num_warps=4, **launch_options(q_lora.device),
        )
    return q_latent, kv
