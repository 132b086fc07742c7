"""Loading one [BLOCK_N, BLOCK_K] tile of a projection weight in any of the release's formats.

Formats (MODEL_SPEC §8, `deepinfer_core.quantization`), the kernels' FORMAT constexpr in brackets:
- DENSE (0): the weight in the compute dtype.
- FP8 (1): float8_e4m3fn values; the (bn x bk) block scale is a power of two, so the caller multiplies the
  tile's partial product by it (exact) instead of scaling every element: tiles never straddle a block.
- FP4 (2): e2m1 codes, two per byte (even column in the low nibble), one e8m0 scale per 32 columns, applied
  here per 32-column group. Decoding builds float16 bits from the code bits: no lookup table, no sm_90-only
  instruction, so the same code runs on SM100. Triton's `tl.dot_scaled` (the native fp4 MMA on SM100) was
  measured on the H200: as fast at decode sizes, 1.6x slower at prefill, and the CPU interpreter the tests
  run through lacks it (BENCHMARKS.md).

Scales arrive as raw uint8 e8m0 bytes (value 2^(byte - 127)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["as_kernel_weight", "e2m1_as_fp16", "e8m0_to_float", "load_weight_tile", "weight_format"]


def weight_format(weight: torch.Tensor) -> int:
    """The FORMAT constexpr of the kernels: 0 dense, 1 fp8 e4m3 block-scaled, 2 packed fp4 e2m1."""
    if weight.dtype == torch.float8_e4m3fn:
        return 1
    if weight.dtype == torch.int8:
        return 2
    return 0


def as_kernel_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale bytes) as the kernels read them: packed fp4 as uint8, e8m0 scales as uint8."""
    if weight.dtype == torch.int8:
        weight = weight.view(torch.uint8)
    scale_bytes = scale.view(torch.uint8) if scale is not None else weight
    return weight, scale_bytes


@triton.jit
def e8m0_to_float(byte):
    return tl.exp2(byte.to(tl.float32) - 127.0)


@triton.jit
def e2m1_as_fp16(code):
    """The low nibble of int32 `code` (e2m1: sign, 2 exponent bits, 1 mantissa bit) as float16 equal to its
    value * 2^-14: the magnitude bits land in the exponent's and mantissa's lowest bits, so the
    exponent-0 codes become float16 subnormals (0.5 -> 2^-15) and no case needs a select. Five integer
    ops; the bf16 bit layout needs a select for those codes and ran 1.7x slower (BENCHMARKS.md)."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def load_weight_tile(
    w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] tile of W (rows offs_n, columns k0..k0+BLOCK_K) in the COMPUTE dtype; FP8 unscaled.

    FP4 tiles (BLOCK_K a multiple of 32, k0 too) load their packed bytes and scales once each, as
    contiguous rows, and decode both nibbles of a byte at once.
    """
    rows = offs_n[:, None].to(tl.int64)
    if FORMAT == 2:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows * stride_wn + pairs[None, :],
                         mask=(offs_n[:, None] < N) & (pairs[None, :] < K // 2), other=0).to(tl.int32)
        values = tl.reshape(tl.join(e2m1_as_fp16(packed), e2m1_as_fp16(packed >> 4)), [offs_n.shape[0], BLOCK_K])
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale = e8m0_to_float(tl.load(s_ptr + rows * stride_sn + groups[None, :],
                                      mask=(offs_n[:, None] < N) & (groups[None, :] < K // 32), other=127))
        # 2^14 undoes e2m1_as_fp16's offset (exact); a separate product, so no scale byte overflows
        grouped = tl.reshape(values.to(tl.float32), [offs_n.shape[0], BLOCK_K // 32, 32]) * 16384.0
        return tl.reshape(grouped * scale[:, :, None], [offs_n.shape[0], BLOCK_K]).to(COMPUTE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        return tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(COMPUTE)
