"""W8A8 projections of prefill size on cuBLAS's block-scaled fp8 GEMM (`torch._scaled_mm`).

DeepSeek's fp8 recipe, x quantised per row in groups of 128 columns and W in 128 x 128 blocks, is one of
cuBLAS's scaling modes on sm_90 from CUDA 12.9 (torch exposes it through the scale tensors' shapes). x is
quantised by the same Triton launch as the Triton W8A8 path (`activation_quant.quantize_fp8_rows`), so both
paths meet the same fp8 codes and scales; on an H100 (CUDA 13.0) cuBLAS's products were bitwise equal to
the Triton `linear`'s at 512 to 8,192 rows of every (ungrouped) V4-Flash projection, and faster on most: wq_b and
wo_b 1.5x at 8,192 rows, the small wkv slower at 4,096 (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch

from deepinfer_kernels.activation_quant import quantize_fp8_rows

__all__ = ["block_scaled_codes_mm", "block_scaled_mm", "block_scaled_supported"]

BLOCK = (128, 128)


@functools.cache
def _device_has_it(device: torch.device) -> bool:
    """sm_90 (torch implements the recipe for Hopper only; SM100's block-scaled modes are MX formats) with
    a CUDA of at least 12.9."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability(device) == (9, 0) and (major, minor) >= (12, 9)


def block_scaled_supported(dtype: torch.dtype, device: torch.device, weight: torch.Tensor,
                           block: tuple[int, int] | None, rows: int) -> bool:
    """Whether `block_scaled_mm` takes x [rows, K] of `dtype` on `device` and an fp8 weight [N, K]: 128 x 128 blocks
    that tile W whole, K in whole groups of four blocks (cuBLAS's scale layout pads K's blocks to a multiple of
    four), rows a multiple of 4 (cuBLASLt's), on a device that has it."""
    n, k = weight.shape
    return (weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() and tuple(block or ()) == BLOCK
            and dtype == torch.bfloat16 and n % BLOCK[0] == 0 and k % (4 * BLOCK[1]) == 0 and rows % 4 == 0
            and _device_has_it(device))


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ W.T for W fp8 [N, K] (contiguous) with e8m0 block scales [N/128, K/128]:
    [M, N] bf16."""
    codes, x_scales = quantize_fp8_rows(x if x.stride(-1) == 1 else x.contiguous(), BLOCK[1])
    return block_scaled_codes_mm(codes, x_scales, weight, scale)


def block_scaled_codes_mm(codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                          scale: torch.Tensor) -> torch.Tensor:
    """`block_scaled_mm` of x given as its fp8 codes [M, K] and float32 scales [M, K/128] (`quantize_fp8_rows`' of
    x, or a producer's that quantised its own output): [M, N] bf16."""
    # cuBLAS reads both scale tensors column-major: x's [M, K/128] with stride (1, M), W's as [K/128, N/128]
    # with stride (1, K/128), which is W's row-major [N/128, K/128] transposed.
    return torch._scaled_mm(codes, weight.t(), x_scales.t().contiguous().t(), scale.float().t(),
                            out_dtype=torch.bfloat16)
