"""fp8 block-scaled weights widened to a float dtype in one pass (`KernelOps.dequantize_weight`).

A prefill-sized projection of bf16 activations multiplies a widened weight on cuBLAS (`TritonOps.linear`); the
reference's widening takes four float32 passes over the weight (convert, scale in place, round), this one reads
each fp8 code once and writes the result once, bit for bit the same: code * 2^(byte - 127) is exact in float32
and rounds once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["dequantize_fp8_weight", "fp8_weight_supported"]

_BLOCK_ROWS = 16
_BLOCK_COLS = 512


@triton.jit
def _e8m0_factor(byte):
    """2^(byte - 127) as float32 for every byte, as torch converts float8_e8m0fnu: byte 0 is the subnormal
    2^-127 and byte 255 is NaN (exp2 on the GPU would flush the one and give inf for the other)."""
    bits = tl.where(byte == 0, 0x00400000, tl.where(byte == 255, 0x7FC00000, byte.to(tl.int32) << 23))
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_fp8_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sk, stride_on,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    codes = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    scales = tl.load(s_ptr + (rows // SCALE_BN)[:, None] * stride_sn + (cols // SCALE_BK)[None, :] * stride_sk,
                     mask=mask, other=127)
    values = codes.to(tl.float32) * _e8m0_factor(scales)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :],
             values.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_weight_supported(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                         dtype: torch.dtype) -> bool:
    """A 2-D float8_e4m3fn weight of unit column stride with its e8m0 scales, one per block, into float32 / bf16 /
    fp16. (Anything else is the reference's to take or to refuse with the error it names.)"""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1 or block is None:
        return False
    blocks = (triton.cdiv(weight.shape[0], block[0]), triton.cdiv(weight.shape[1], block[1]))
    return (scale is not None and scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == blocks
            and dtype in (torch.float32, torch.bfloat16, torch.float16))


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """W[i, j] = weight[i, j] * 2^(scale[i // bn, j // bk] - 127) as `dtype` [N, K], for what
    `fp8_weight_supported` accepts."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if out.numel():
        scales = scale.view(torch.uint8)
        _dequantize_fp8_kernel[(triton.cdiv(n, _BLOCK_ROWS), triton.cdiv(k, _BLOCK_COLS))](
            weight, scales, out, n, k, weight.stride(0), scales.stride(0), scales.stride(1), out.stride(0),
            SCALE_BN=block[0], SCALE_BK=block[1], BLOCK_N=_BLOCK_ROWS, BLOCK_K=_BLOCK_COLS, num_warps=4,
            **launch_options(weight.device),
        )
    return out
