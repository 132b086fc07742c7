"""Loading one [BLOCK_N, BLOCK_K] tile of a projection weight in any of the release's formats.

Formats (MODEL_SPEC §8, `deepinfer_core.quantization`), the kernels' FORMAT constexpr in brackets:
- DENSE (0): the weight in the compute dtype.
- FP8 (1): float8_e4m3fn values; the (bn x bk) block scale is a power of two, so the caller multiplies the
  tile's partial product by it (exact) instead of scaling every element: tiles never straddle a block.
- FP4 (2): e2m1 codes, two per byte (even column in the low nibble), one e8m0 scale per 32 columns, applied
  here element-wise. Decoding is arithmetic on the code bits: no lookup table, no sm_90-only instruction,
  so the same code runs on SM100 (whose native fp4 MMA path can replace it later).

Scales arrive as raw uint8 e8m0 bytes (value 2^(byte - 127)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["as_kernel_weight", "e2m1_to_float", "e8m0_to_float", "load_weight_tile", "weight_format"]


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
def e2m1_to_float(code):
    """Value of a 4-bit e2m1 code: sign bit 3, exponent bits 2:1, mantissa bit 0."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 2.0))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def load_weight_tile(
    w_ptr, s_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, COMPUTE: tl.constexpr
):
    """[BLOCK_N, BLOCK_K] tile of W (rows offs_n, columns offs_k) in the COMPUTE dtype; FP8 unscaled."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n[:, None].to(tl.int64)
    if FORMAT == 2:
        packed = tl.load(w_ptr + rows * stride_wn + offs_k[None, :] // 2, mask=mask, other=0)
        code = (packed.to(tl.int32) >> ((offs_k[None, :] & 1) * 4)) & 15
        scale = e8m0_to_float(tl.load(s_ptr + rows * stride_sn + offs_k[None, :] // 32, mask=mask, other=127))
        return (e2m1_to_float(code) * scale).to(COMPUTE)
    else:
        return tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(COMPUTE)
