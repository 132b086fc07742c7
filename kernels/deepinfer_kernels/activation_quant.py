"""Activations quantised to fp8 for W8A8 products (`KernelOps.fp8_activations`).

Each row's consecutive `group` columns (the fp8 weight's K block) share one power-of-two scale 2^e, e the
smallest with max(amax, 1e-4) <= 448 * 2^e; each value becomes the nearest e4m3 value of x / 2^e, ties to
even: `quantization.fake_quantize_fp8_activations`, bit for bit. The rounding is done in float32 integer
and add arithmetic (no reliance on the float-to-fp8 conversion's rounding mode, which Triton's CPU
interpreter gets wrong near powers of two), so the final cast only converts exact values.

One pass writes the codes and scales; the GEMMs then stream fp8 tiles straight into the fp8 tensor cores. Or it
writes the rounded values themselves in x's dtype (`fake_quantize_fp8_rows`), for a product that multiplies
them in bf16 (cuBLAS, or `linear`'s W8A16 tiles): exactly the W8A8 product, for weight blocks that no fp8 GEMM at
hand takes or that leave the fp8 tiles too little work (V4.1's 32 x 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = [
    "activation_group_supported", "fake_quantize_fp8_rows", "fake_quantize_supported", "fp8_activation_tiles_supported",
    "quantize_fp8_rows", "quantize_groups",
]

# A program's tile: ROW_TILE rows of one group, or of ROW_SEGMENT columns (whole groups) above SEGMENT_ROWS rows, so
# that each row's loads are long contiguous runs. H100, graph replay: 8,192 x 5,120 bf16 in groups of 32 rounded in
# 99.0 -> 61.5 us (1.08x a clone's time), codes and scales 99.4 -> 47.8; at 1 / 64 rows the wide tiles left too
# few programs (1.2 -> 1.9, 1.7 -> 2.1 us).
ROW_TILE = 16
ROW_SEGMENT = 256
SEGMENT_ROWS = 64


def fp8_activation_tiles_supported(block: tuple[int, int] | None) -> bool:
    """A GEMM's K tile must be the weight's K block (one scale per tile for x and W): a power of two
    from 32 (the fp8 MMA's K) to 128 (the kernels' longest fp8 K tile)."""
    return block is not None and block[1] in (32, 64, 128)


def fake_quantize_supported(x: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """`fake_quantize_fp8_rows` takes x of unit column stride in float32 / bf16 / fp16, in K groups that
    `activation_group_supported`."""
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and activation_group_supported(block))


def activation_group_supported(block: tuple[int, int] | None) -> bool:
    """A weight block whose K columns the row launches take as one group of x: a power of two from 16 to 256."""
    group = block[1] if block is not None else 0
    return 16 <= group <= 256 and group & (group - 1) == 0


@triton.jit
def _pow2(exponent):
    """2^exponent (int32 in [-126, 127]) as float32, built from bits so that it is exact on every target."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even: adding 2^(e + 20), e the
    value's exponent but at least -6 (below it e4m3 steps by 2^-9), leaves 3 mantissa bits, and the
    float32 add itself rounds to nearest even."""
    magnitude = tl.abs(v)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = _pow2(exponent + 20)
    rounded = (magnitude + magic) - magic
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def quantize_groups(x, AXIS: tl.constexpr):
    """float32 x quantised in groups along AXIS (the whole axis one group; zeros past a group's end change
    nothing): (its e4m3 values in units of the group's scale, as float32; the scales 2^e, AXIS reduced). For
    kernels that quantise what they compute (the MoE's activation in its gate / up epilogue)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    # amax = m * 2^p with 1 <= m < 2, and 448 = 1.75 * 2^8: e = p - 8, or p - 7 when m > 1.75
    exponent = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return _round_to_e4m3(x * tl.expand_dims(_pow2(-exponent), AXIS)), _pow2(exponent)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scales_ptr, M, K, stride_xm, stride_cm, stride_sm,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, FAKE: tl.constexpr, PDL: tl.constexpr,
):
    """A program takes BLOCK_M rows of GROUPS consecutive groups, a [BLOCK_M, GROUPS, GROUP] tile.
    FAKE: codes_ptr takes the rounded values times their scale (exact in bf16 and float32), no scales."""
    wait_for_previous_grid(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs_k = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    rows = offs_m[:, None, None].to(tl.int64)
    mask = (rows < M) & (offs_k < K)
    x = tl.load(x_ptr + rows * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    rounded, scales = quantize_groups(x, 2)
    if FAKE:
        rounded = rounded * scales[:, :, None]
    tl.store(codes_ptr + rows * stride_cm + offs_k, rounded.to(codes_ptr.dtype.element_ty), mask=mask)
    if not FAKE:
        group_mask = (offs_m[:, None] < M) & (groups[None, :] * GROUP < K)
        tl.store(scales_ptr + offs_m[:, None].to(tl.int64) * stride_sm + groups[None, :], scales, mask=group_mask)


def quantize_fp8_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row stride free, unit column stride) as (float8_e4m3fn codes [M, K], float32 scales
    [M, ceil(K / group)]): x[m, k] ~ codes[m, k] * scales[m, k // group]."""
    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, triton.cdiv(cols, group)), dtype=torch.float32, device=x.device)
    _launch(x, codes, scales, group, fake=False)
    return codes, scales


def fake_quantize_fp8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (row stride free, unit column stride) rounded as `quantize_fp8_rows` rounds it, in x's dtype
    [M, K]: `quantization.fake_quantize_fp8_activations`, bit for bit."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, out, out, group, fake=True)
    return out


def _launch(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, group: int, fake: bool) -> None:
    rows, cols = x.shape
    groups = max(ROW_SEGMENT // group, 1) if rows > SEGMENT_ROWS else 1
    _quantize_rows_kernel[(triton.cdiv(rows, ROW_TILE), triton.cdiv(cols, group * groups))](
        x, out, scales, rows, cols, x.stride(0), out.stride(0), scales.stride(0),
        GROUP=group, GROUPS=groups, BLOCK_M=ROW_TILE, FAKE=fake, num_warps=4, **launch_options(x.device),
    )
