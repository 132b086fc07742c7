"""The kernels' fp4 weight decoding (`weight_tiles.load_weight_tile`) against `dequantize_fp4`, bit for bit."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
import triton
import triton.language as tl

from deepinfer_core.quantization import dequantize_fp4
from deepinfer_kernels.weight_tiles import FP4_SMALL_SCALES, as_kernel_weight, fp4_scales_small, load_weight_tile

ROWS, COLS = 16, 64


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    tile = load_weight_tile(w_ptr, s_ptr, offs_n, 0, N, K, stride_wn, stride_sn, FORMAT, out_ptr.dtype.element_ty,
                            BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], tile)


def _every_code(scale_bytes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [ROWS, COLS/2] holding each of the 16 codes in each nibble position, and e8m0 scales cycling
    through `scale_bytes`."""
    gen = torch.Generator().manual_seed(0)
    low, high = torch.randint(0, 16, (2, ROWS, COLS // 2), generator=gen)
    low[0], high[0] = torch.arange(COLS // 2) % 16, (torch.arange(COLS // 2) + 5) % 16
    packed = (low | (high << 4)).to(torch.uint8).view(torch.int8)
    groups = torch.tensor(scale_bytes)[torch.arange(ROWS * COLS // 32) % len(scale_bytes)]
    return packed, groups.view(ROWS, COLS // 32).to(torch.uint8).view(torch.float8_e8m0fnu)


def _decoded(packed: torch.Tensor, scale: torch.Tensor, fmt: int, dtype: torch.dtype) -> torch.Tensor:
    w, s = as_kernel_weight(packed, scale)
    out = torch.empty(ROWS, COLS, dtype=dtype)
    _tile_kernel[(1,)](w, s, out, ROWS, COLS, w.stride(0), s.stride(0), FORMAT=fmt, BLOCK_N=ROWS, BLOCK_K=COLS)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "scale_bytes"), [
    (2, [0, 1, 90, 127, 128, 129, 200, 250]),  # any scale: two products
    (FP4_SMALL_SCALES, [0, 1, 90, 126, 127, 128]),  # scales <= 2: one product
])
def test_every_code_and_scale_decodes_exactly(dtype, fmt, scale_bytes):
    packed, scale = _every_code(scale_bytes)
    assert fp4_scales_small(scale) == (fmt == FP4_SMALL_SCALES)
    expected = dequantize_fp4(packed, scale, dtype)
    assert torch.equal(_decoded(packed, scale, fmt, dtype).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
