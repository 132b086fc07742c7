"""Interleaved partial RoPE: each program takes TOKENS tokens' rows (BLOCK_R of each) of the last dim, copies
their leading channels and rotates the trailing 2*len(inv_freq) in pairs, in one read and one write; in place,
only the rotated channels are read and written (a 512-wide head with 64 rotated channels: 1/8 of the bytes).
The rotated channels load as one contiguous run a row and split into their pairs in registers; cos and sin are
computed once a token, for all its rows. H100, the indexer's q of 8,192 tokens x 64 heads x 128 in place: 53 us,
against 319 us (~7x the bytes' time) loading the pairs' two halves with stride 2 and taking cos / sin a row, 16 rows
a program; the same bits (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["rope", "rope_supported", "rotate_tile"]

# Rows per program: one head's 32 rotated pairs alone are too little work for a program.
ROWS = 64


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, num_tokens, rows_per_token, D, HALF: tl.constexpr, SIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    in_token = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = (tokens < num_tokens)[:, None] & (in_token < rows_per_token)[None, :]  # [TOKENS, BLOCK_R]
    base = (tokens.to(tl.int64)[:, None] * rows_per_token + in_token[None, :]) * D
    dtype = out_ptr.dtype.element_ty
    lead = D - 2 * HALF
    if not IN_PLACE:
        cols = tl.arange(0, BLOCK_D)
        keep = live[:, :, None] & (cols[None, None, :] < lead)
        at = base[:, :, None] + cols[None, None, :]
        tl.store(out_ptr + at, tl.load(x_ptr + at, mask=keep), mask=keep)

    position = tl.load(pos_ptr + tokens, mask=tokens < num_tokens, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(freq_ptr + tl.arange(0, HALF))[None, :]  # [TOKENS, HALF]
    # cos / sin rounded to the activations' dtype first, as the reference model does
    cos = tl.cos(angle).to(dtype).to(tl.float32)[:, None, :]
    sin = SIGN * tl.sin(angle).to(dtype).to(tl.float32)[:, None, :]
    at = base[:, :, None] + lead + tl.arange(0, 2 * HALF)[None, None, :]
    rotated = live[:, :, None]
    a, b = tl.split(tl.reshape(tl.load(x_ptr + at, mask=rotated), [TOKENS, BLOCK_R, HALF, 2]))
    a, b = a.to(tl.float32), b.to(tl.float32)
    pairs = tl.join((a * cos - b * sin).to(dtype), (b * cos + a * sin).to(dtype))
    tl.store(out_ptr + at, tl.reshape(pairs, [TOKENS, BLOCK_R, 2 * HALF]), mask=rotated)


@triton.jit
def rotate_tile(x, position, freq_ptr, D, HALF, SIGN: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rope of one token's rows held in registers: x [ROWS, BLOCK_D] (columns past D unused) with
    channels D - 2*HALF .. D - 1 rotated at `position` in interleaved pairs, rounded as `_rope_kernel`
    rounds, in x's dtype. For kernels that rotate what they load or store (the attention's query and
    output) instead of a pass of their own over it."""
    rows: tl.constexpr = x.shape[0]
    dtype = x.dtype
    a, b = tl.split(tl.reshape(x, [rows, BLOCK_D // 2, 2]))
    pair = tl.arange(0, BLOCK_D // 2)
    first = (D - 2 * HALF) // 2
    rotated = (pair >= first) & (pair < D // 2)
    angle = position.to(tl.float32) * tl.load(freq_ptr + pair - first, mask=rotated, other=0.0)
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = SIGN * tl.sin(angle).to(dtype).to(tl.float32)[None, :]
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    a = tl.where(rotated[None, :], (a32 * cos - b32 * sin).to(dtype), a)
    b = tl.where(rotated[None, :], (b32 * cos + a32 * sin).to(dtype), b)
    return tl.reshape(tl.join(a, b), [rows, BLOCK_D])


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
    tokens = x.shape[0]
    if x.numel():
        rows_per_token = x.numel() // (d * tokens)
        block_r = min(triton.next_power_of_2(rows_per_token), ROWS)
        per_program = ROWS // block_r
        _rope_kernel[(triton.cdiv(tokens, per_program), triton.cdiv(rows_per_token, block_r))](
            x, positions.contiguous(), inv_freq.float().contiguous(), out, tokens, rows_per_token, d,
            HALF=half, SIGN=-1.0 if inverse else 1.0, BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
            TOKENS=per_program, BLOCK_R=block_r, IN_PLACE=in_place, **launch_options(x.device),
        )
    return out


def rope_supported(inv_freq: torch.Tensor) -> bool:
    half = inv_freq.shape[0]
    return half > 0 and half & (half - 1) == 0
