"""The kernels' fp4 and fine-block fp8 weight decoding (`weight_tiles.load_weight_tile`) against the dequantised
weights, bit for bit."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch

from deepinfer_core.quantization import dequantize_fp4, dequantize_fp8_block, quantize_fp8_block
from deepinfer_kernels.weight_tiles import (
    FP4_PAIR_ORDER, FP4_SMALL_SCALES, FP8_SCALED_TILES, decoded_weight, fp4_scales_small, fp8_tiles, pair_order_columns,
)

ROWS, COLS = 16, 64


def _every_code(scale_bytes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [ROWS, COLS/2] holding each of the 16 codes in each nibble position, and e8m0 scales cycling
    through `scale_bytes`."""
    gen = torch.Generator().manual_seed(0)
    low, high = torch.randint(0, 16, (2, ROWS, COLS // 2), generator=gen)
    low[0], high[0] = torch.arange(COLS // 2) % 16, (torch.arange(COLS // 2) + 5) % 16
    packed = (low | (high << 4)).to(torch.uint8).view(torch.int8)
    groups = torch.tensor(scale_bytes)[torch.arange(ROWS * COLS // 32) % len(scale_bytes)]
    return packed, groups.view(ROWS, COLS // 32).to(torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "scale_bytes"), [
    (2, [0, 1, 90, 127, 128, 129, 200, 250]),  # any scale: two products
    (FP4_SMALL_SCALES, [0, 1, 90, 126, 127, 128]),  # scales <= 2: one product
    (FP4_PAIR_ORDER, [0, 1, 90, 126, 127, 128]),  # the same, its columns in pair order
])
def test_every_code_and_scale_decodes_exactly(dtype, fmt, scale_bytes):
    packed, scale = _every_code(scale_bytes)
    assert fp4_scales_small(scale) == (fmt != 2)
    expected = dequantize_fp4(packed, scale, dtype)
    if fmt == FP4_PAIR_ORDER:  # within each 8 columns: 0, 4, 1, 5, 2, 6, 3, 7
        expected = pair_order_columns(expected)
    assert torch.equal(decoded_weight(packed, scale, fmt, dtype, ROWS, COLS).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_blocks_smaller_than_the_tile_are_scaled_exactly_in_it(dtype):
    """FP8_SCALED_TILES: a [16, 64] tile of (8 x 16)-blocks, each weight times its block's power-of-two scale,
    bit for bit the dequantised weight (as V4.1's 32 x 32 blocks under 64 x 128 tiles)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(ROWS, COLS, generator=gen) * torch.exp2(torch.randint(-20, 20, (ROWS, COLS), generator=gen).float())
    values, scale = quantize_fp8_block(w, (8, 16))
    expected = dequantize_fp8_block(values, scale, (8, 16), dtype)
    assert fp8_tiles((8, 16), ROWS, COLS) == (FP8_SCALED_TILES, ROWS, COLS)
    assert torch.equal(decoded_weight(values, scale, FP8_SCALED_TILES, dtype, ROWS, COLS, (8, 16)), expected)


def test_fp8_tiles_keep_a_tile_inside_a_block_or_of_whole_blocks():
    assert fp8_tiles((128, 128), 64, 128) == (1, 64, 128)  # V4's blocks: scaled after the product
    assert fp8_tiles((32, 32), 64, 128) == (FP8_SCALED_TILES, 64, 128)  # V4.1's: scaled in the tile
    assert fp8_tiles((48, 32), 64, 128) == (1, 48, 32)  # neither: shrunk to the block
