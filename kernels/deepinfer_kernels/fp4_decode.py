"""DeepSeek-V4.1's fp4 KV vectors decoded in one pass: e2m1 codes, two a byte, times one scale per block.

The reference builds the values through a table lookup on int64 codes and three more full-size
intermediates; a decode step reads every index key of a band this way (and the attention's picked
entries). Here each byte is read once and its two values written in order. The products are exact in
float32 (two significant bits of the code's value times an e4m3 or power-of-two scale), so the result
equals the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["fp4_block_dequantize"]

ROWS_PER_PROGRAM = 8


@triton.jit
def _pow2(k):
    """2.0 ** k for int32 k in the normal range, from the exponent bits (exact, unlike an approximate exp2)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(code):
    """float32 value of 4-bit e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, _pow2(exponent - 1) * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _fp4_decode_kernel(
    packed_ptr, scales_ptr, out_ptr, rows, pairs, n_scales, PAIRS_PER_SCALE: tl.constexpr,
    E4M3: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pair = tl.arange(0, BLOCK_P)
    ok = (row[:, None] < rows) & (pair[None, :] < pairs)
    row64 = row.to(tl.int64)[:, None]
    byte = tl.load(packed_ptr + row64 * pairs + pair[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(scales_ptr + row64 * n_scales + pair[None, :] // PAIRS_PER_SCALE, mask=ok, other=127).to(tl.int32)
    # every byte decodes as torch does (a written scale is positive and finite, but the codes are the data)
    if E4M3:  # e4m3fn: sign, 4 exponent bits of bias 7 (subnormals at 0), 3 mantissa bits; S.1111.111 is NaN
        exp_bits = (s >> 3) & 15
        mant = (s & 7).to(tl.float32)
        scale = tl.where(exp_bits == 0, mant * 0.001953125, _pow2(exp_bits - 7) * (1.0 + 0.125 * mant))
        scale = tl.where((s & 0x80) != 0, -scale, scale)
        scale = tl.where((s & 0x7F) == 0x7F, float("nan"), scale)
    else:  # ue8m0: 2^(s - 127); 0 is the subnormal 2^-127
        scale = tl.where(s == 0, 5.877471754111438e-39, _pow2(s - 127))
    low = _e2m1_value(byte & 15) * scale
    high = _e2m1_value(byte >> 4) * scale
    values = tl.reshape(tl.join(low, high), (ROWS, 2 * BLOCK_P))
    col = tl.arange(0, 2 * BLOCK_P)
    out_ok = (row[:, None] < rows) & (col[None, :] < 2 * pairs)
    tl.store(out_ptr + row64 * (2 * pairs) + col[None, :], values.to(out_ptr.dtype.element_ty), mask=out_ok)


def fp4_block_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`KernelOps.fp4_block_dequantize`: packed uint8 [..., d/2] (channel 2j in the low nibble), scales
    float8_e4m3fn or uint8 (ue8m0) [..., d/block] -> [..., d] in `dtype`."""
    lead, pairs, n_scales = packed.shape[:-1], packed.shape[-1], scales.shape[-1]
    out = torch.empty((*lead, 2 * pairs), dtype=dtype, device=packed.device)
    rows = out.numel() // max(2 * pairs, 1)
    if rows == 0 or pairs == 0:
        return out
    block = 2 * pairs // n_scales
    _fp4_decode_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        packed.contiguous(), scales.contiguous().view(torch.uint8), out, rows, pairs, n_scales,
        PAIRS_PER_SCALE=block // 2, E4M3=scales.dtype == torch.float8_e4m3fn, ROWS=ROWS_PER_PROGRAM,
        BLOCK_P=triton.next_power_of_2(pairs), **launch_options(packed.device),
    )
    return out
