"""Interleaved partial RoPE: one program per row of the last dim, the leading channels copied and the
trailing 2*len(inv_freq) rotated in pairs, in one read and one write of the row; in place, only the
rotated channels are read and written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope", "rope_supported"]


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, rows_per_token, D, HALF: tl.constexpr, SIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, IN_PLACE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * D
    dtype = out_ptr.dtype.element_ty
    lead = D - 2 * HALF
    if not IN_PLACE:
        cols = tl.arange(0, BLOCK_D)
        keep = cols < lead
        tl.store(out_ptr + base + cols, tl.load(x_ptr + base + cols, mask=keep), mask=keep)

    pairs = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + row // rows_per_token).to(tl.float32) * tl.load(freq_ptr + pairs)
    # cos / sin rounded to the activations' dtype first, as the reference model does
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = SIGN * tl.sin(angle).to(dtype).to(tl.float32)
    even = base + lead + 2 * pairs
    a = tl.load(x_ptr + even).to(tl.float32)
    b = tl.load(x_ptr + even + 1).to(tl.float32)
    tl.store(out_ptr + even, (a * cos - b * sin).to(dtype))
    tl.store(out_ptr + even + 1, (b * cos + a * sin).to(dtype))


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    """`KernelOps.rope`: x [T, ..., d], positions [T], inv_freq [r/2] float32 (r/2 a power of two);
    `inplace`: x is rotated in place (when contiguous, else its contiguous copy) and returned."""
    half = inv_freq.shape[0]
    in_place = inplace and x.is_contiguous()
    x = x.contiguous()
    out = x if in_place else torch.empty_like(x)
    d = x.shape[-1]
    rows = x.numel() // d
    if rows:
        _rope_kernel[(rows,)](
            x, positions.contiguous(), inv_freq.float().contiguous(), out, rows // x.shape[0], d,
            HALF=half, SIGN=-1.0 if inverse else 1.0, BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
            IN_PLACE=in_place,
        )
    return out


def rope_supported(inv_freq: torch.Tensor) -> bool:
    half = inv_freq.shape[0]
    return half > 0 and half & (half - 1) == 0
