"""Triton `linear` (dense, fp8 block-scaled, packed fp4 weights) against `KernelOps.linear`."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps, QuantizedActivations
from deepinfer_core.quantization import quantize_fp4, quantize_fp8_activations, quantize_fp8_block
from deepinfer_kernels.linear import FP8_MMA_BLOCK_KS, grouped_linear, linear, linear_supported, split_k
from deepinfer_nvidia.ops import TritonOps

# Same dequantised weights on both sides (power-of-two scales are exact), so only the float32
# accumulation order differs: float32 ~1e-7; bfloat16 adds the output rounding (~4e-3 in norm).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def _weight(fmt: str, n: int, k: int, gen: torch.Generator, dtype: torch.dtype):
    w = torch.randn(n, k, generator=gen) / 8
    if fmt == "fp8":
        block = (32, 64)
        return (*quantize_fp8_block(w, block), block)
    if fmt == "fp4":
        return (*quantize_fp4(w), None)
    return w.to(dtype), None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
@pytest.mark.parametrize("m,n,k", [(1, 72, 96), (37, 83, 160), (70, 130, 64), (520, 72, 64)])  # 64- and 128-row tiles
def test_linear_matches_reference(dtype, fmt, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight, scale, block = _weight(fmt, n, k, gen, dtype)
    assert linear_supported(weight, block)
    out = linear(x, weight, scale, block)
    assert_matches(out, KernelOps().linear(x, weight, scale, block), TOLERANCE[dtype])


def test_rows_between_decode_and_prefill_take_64_row_tiles_except_beside_a_tall_weight():
    """65-512 rows: 64-row tiles (more programs for a projection whose weight L2 keeps between the passes), not for a
    weight of the LM head's height, which each extra row tile streams again from memory."""
    from deepinfer_kernels.linear import SIXTY_FOUR_ROW_TILES, TALL_WEIGHT_ROWS, tile_config

    for rows in (65, 200, SIXTY_FOUR_ROW_TILES):
        assert tile_config(rows, 1, weight_rows=1280)[0] == 64
        assert tile_config(rows, 0, weight_rows=TALL_WEIGHT_ROWS + 1)[0] == 128
    assert tile_config(SIXTY_FOUR_ROW_TILES + 1, 0, weight_rows=1280)[0] == 128
    assert tile_config(64, 0, weight_rows=TALL_WEIGHT_ROWS + 1)[0] == 64


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("num_sms", [None, 132])
def test_float32_x_meets_a_bf16_weight_widened(rows, num_sms):
    """V4.1's float32 products of bf16 weights (compressor, router): up to FLOAT32_ROW_TILES rows on one-row
    tiles, which widen the weight as they load it; more rows on the MMA tiles, of a float32 copy."""
    from deepinfer_kernels.linear import FLOAT32_ROW_TILES, one_row_tiles

    assert one_row_tiles(rows, 0, None, False, float32_x=True) == (rows <= FLOAT32_ROW_TILES)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 320, generator=gen)
    weight = (torch.randn(70, 320, generator=gen) / 8).to(torch.bfloat16)
    out = linear(x, weight, None, None, num_sms=num_sms)
    assert out.dtype == torch.float32
    assert_matches(out, torch.nn.functional.linear(x, weight.float()), TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_split_k_matches_reference(dtype, fmt):
    """Few output tiles on a many-SM device: K split in ranges (the last one short), partials summed."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 3, 70, 1088
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight, scale, block = _weight(fmt, n, k, gen, dtype)
    assert split_k(2, k, 64, 132, fill=2) == 4  # 4 ranges of 320, 320, 320, 128
    out = linear(x, weight, scale, block, num_sms=132)
    assert_matches(out, KernelOps().linear(x, weight, scale, block), TOLERANCE[dtype])
    assert torch.equal(out, linear(x, weight, scale, block, num_sms=132)), "not the same on every run"
    from deepinfer_kernels.linear import _arrival_counters

    assert not _arrival_counters(x.device, 1).any(), "the last arrival of each tile resets its counter"


def test_measured_decode_tiles_only_for_w8a16_launches_up_to_64_rows():
    """FP8_DECODE_TILES: V4-Flash's wo_b (4,096 x 8,192) at 2-16 rows takes the 2-16 entry's tile and split fill
    (in 16-row tiles), at 17-32 rows the 32-row entry's; more rows, a bf16 weight, or no K given (fp8 activations,
    batch-invariant mode) take the rule's."""
    from deepinfer_kernels.linear import FP8_DECODE_TILES, tile_config

    assert FP8_DECODE_TILES[16, 4096, 8192] == (128, 8, 3, 2)
    assert tile_config(16, 1, weight_rows=4096, k=8192) == (16, 128, 128, 8, 3, 2)
    assert tile_config(2, 1, weight_rows=4096, k=8192) == (16, 128, 128, 8, 3, 2)
    assert tile_config(17, 1, weight_rows=4096, k=8192) == (32, 64, 128, 4, 3, 4)
    rule = tile_config(16, 1, weight_rows=4096)
    assert rule != tile_config(16, 1, weight_rows=4096, k=8192)
    assert tile_config(16, 0, weight_rows=4096, k=8192) == tile_config(16, 0, weight_rows=4096)
    assert tile_config(65, 1, weight_rows=4096, k=8192) == tile_config(65, 1, weight_rows=4096)
    assert split_k(64, 8192, 128, 132, fill=0) == 1  # fill 0: never split


@pytest.mark.parametrize("mode", ["w8a16", "a8", "batch_invariant"])
def test_measured_decode_tile_taken_by_w8a16_launches(monkeypatch, mode):
    """A shape in FP8_DECODE_TILES (here a small one put there for 2-16 rows, with a fill of 0 where the rule's 2
    splits K in 2) gets its tile and split fill in a W8A16 launch that may split K, and matches the reference; W8A8 and
    batch-invariant launches ask the rule (k=0)."""
    import deepinfer_kernels.linear as linear_module

    monkeypatch.setitem(linear_module.FP8_DECODE_TILES, (16, 256, 1024), (32, 4, 3, 0))
    tiles, splits = [], []
    tile_config, split = linear_module.tile_config, linear_module.split_k
    monkeypatch.setattr(linear_module, "tile_config", lambda *a: tiles.append((a, tile_config(*a))) or tiles[-1][1])
    monkeypatch.setattr(linear_module, "split_k", lambda *a: splits.append(split(*a)) or splits[-1])
    gen = torch.Generator().manual_seed(17)
    weight, scale = quantize_fp8_block(torch.randn(256, 1024, generator=gen) / 8, (128, 128))
    x = torch.randn(5, 1024, generator=gen).to(torch.bfloat16)
    out = linear(x, weight, scale, (128, 128), mode == "batch_invariant", 132, mode == "a8")
    (asked, got), = tiles
    assert asked[-1] == (1024 if mode == "w8a16" else 0)
    if mode == "w8a16":
        assert got == (16, 32, 128, 4, 3, 0) and splits == [1]
        assert split(8, 1024, 128, 132, tile_config(16, 1, weight_rows=256)[-1]) == 2
        assert_matches(out, KernelOps().linear(x, weight, scale, (128, 128)), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("num_sms", [None, 132])
def test_tiles_in_row_bands_cover_the_output_once(monkeypatch, num_sms):
    """3 row tiles x 2 column tiles visited in bands of 1, 2 (the last band short) and 3 row tiles (x larger
    than X_IN_L2_BYTES), and whole columns (x within it): the same bits whatever the order, each the
    reference's (split-K included: its counters per tile)."""
    import deepinfer_kernels.linear as linear_module

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 1024, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(200, 1024, generator=gen) / 8).to(torch.bfloat16)
    outs = []
    for band, x_in_l2_bytes in ((1, 0), (2, 0), (3, 0), (8, x.numel() * 2)):
        monkeypatch.setattr(linear_module, "ROW_TILES_A_BAND", band)
        monkeypatch.setattr(linear_module, "X_IN_L2_BYTES", x_in_l2_bytes)
        outs.append(linear(x, weight, None, None, num_sms=num_sms))
    assert_matches(outs[0], KernelOps().linear(x, weight, None, None), TOLERANCE[torch.bfloat16])
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("num_sms", [None, 132])
def test_float32_output_holds_the_product_rounded_to_x(num_sms):
    """`out_dtype` (the LM head's float32 logits): bit for bit the bf16 output widened, with and without
    split-K, and its values are not the unrounded float32 sums."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 1088, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(70, 1088, generator=gen) / 8).to(torch.bfloat16)
    wide = linear(x, weight, None, None, num_sms=num_sms, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, linear(x, weight, None, None, num_sms=num_sms).float())
    assert not torch.equal(wide, x.float() @ weight.float().T)


def test_fp8_mma_tiles_refuse_a_wider_output():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    block = (32, FP8_MMA_BLOCK_KS[-1])
    weight, scale = quantize_fp8_block(torch.randn(64, 128, generator=gen) / 8, block)
    with pytest.raises(ValueError, match="fp8 activations"):
        linear(x, weight, scale, block, fp8_activations=True, out_dtype=torch.float32)


@pytest.mark.parametrize("block", [(32, 128), (32, 64), (32, 32)], ids=["fp8-mma-128", "fp8-mma-64", "x-rounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,splits", [(6, None), (70, None), (3, 132)])
def test_fp8_activations_match_the_reference_rounding(block, dtype, m, splits):
    """W8A8: K blocks of FP8_MMA_BLOCK_KS meet x's fp8 codes on the fp8 MMAs, other K blocks x rounded to its fp8
    values on the W8A16 tiles; the reference rounds x the same way and dequantises, so float32 differs only by
    summation order (a flipped fp8 code would not). K = 192 ends in a partial block."""
    from test_quantization import fp8_activation_rows

    gen = torch.Generator().manual_seed(m)
    x = fp8_activation_rows(m)[:, :192].repeat(m // 6 + 1, 1)[:m].to(dtype)
    weight, scale = quantize_fp8_block(torch.randn(70, 192, generator=gen) / 8, block)
    reference = KernelOps()
    reference.fp8_activations = True
    assert linear_supported(weight, block, fp8_activations=True)
    out = linear(x, weight, scale, block, num_sms=splits, fp8_activations=True)
    assert_matches(out, reference.linear(x, weight, scale, block), TOLERANCE[dtype])
    # a different answer from the W8A16 path: the activations really were rounded
    assert not torch.allclose(out.float(), KernelOps().linear(x, weight, scale, block).float(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("num_sms", [None, 132])
def test_narrow_k_blocks_take_x_rounded_onto_the_w8a16_tiles(num_sms):
    """K blocks outside FP8_MMA_BLOCK_KS (V4.1's 32 x 32): the W8A8 product is the W8A16 tiles' on x rounded to
    its fp8 values (`fake_quantize_fp8_rows`), bit for bit, grouped (strided x) and not."""
    from deepinfer_kernels.activation_quant import fake_quantize_fp8_rows

    assert 32 not in FP8_MMA_BLOCK_KS
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 5, 2, 256, generator=gen).to(torch.bfloat16)[:, :, 0]
    weight, scale = quantize_fp8_block(torch.randn(160, 256, generator=gen) / 8, (32, 32))  # 5 groups of 32 rows
    rounded = fake_quantize_fp8_rows(x.reshape(-1, 256), 32).view(x.shape)
    out = linear(x, weight, scale, (32, 32), num_sms=num_sms, fp8_activations=True)
    assert torch.equal(out, linear(rounded, weight, scale, (32, 32), num_sms=num_sms))
    grouped = grouped_linear(x, weight, scale, (32, 32), num_sms=num_sms, fp8_activations=True)
    assert torch.equal(grouped, grouped_linear(rounded, weight, scale, (32, 32), num_sms=num_sms))


def test_fp8_activations_refuse_blocks_x_cannot_be_grouped_by():
    weight = torch.randn(48, 1024).to(torch.float8_e4m3fn)
    assert linear_supported(weight, (128, 512)) and not linear_supported(weight, (128, 512), fp8_activations=True)
    with pytest.raises(ValueError, match="fp8 activations need"):
        linear(torch.randn(2, 1024), weight, torch.ones(1, 2).to(torch.float8_e8m0fnu), (128, 512),
               fp8_activations=True)


def test_linear_keeps_leading_dims_and_reads_strided_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 2, 64, generator=gen).to(torch.bfloat16)[:, :, 0]
    weight, scale, block = _weight("fp8", 48, 64, gen, torch.bfloat16)
    out = linear(x, weight, scale, block)
    assert out.shape == (2, 5, 48)
    assert_matches(out, KernelOps().linear(x, weight, scale, block), TOLERANCE[torch.bfloat16])


def test_fp8_blocks_the_tiles_cannot_divide_are_refused():
    weight = torch.randn(48, 48).to(torch.float8_e4m3fn)
    assert not linear_supported(weight, (24, 24))


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
@pytest.mark.parametrize("k,num_sms", [(64, None), (1024, 132)])
def test_grouped_linear_matches_reference(fmt, k, num_sms):
    """All groups in one launch (their K split in ranges on a many-SM device), x's rows strided."""
    gen = torch.Generator().manual_seed(len(fmt) + k)
    x = torch.randn(7, 3, k + 32, generator=gen).to(torch.bfloat16)[..., :k]
    weight, scale, block = _weight(fmt, 3 * 32, k, gen, torch.bfloat16)
    out = grouped_linear(x, weight, scale, block, num_sms=num_sms)
    assert_matches(out, KernelOps().grouped_linear(x, weight, scale, block), TOLERANCE[torch.bfloat16])
    if num_sms is None:  # the backend's op launches the same kernel
        assert torch.equal(out, TritonOps().grouped_linear(x, weight, scale, block))


def test_grouped_linear_with_fp8_activations_matches_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 3, 64, generator=gen)
    weight, scale, block = _weight("fp8", 3 * 32, 64, gen, torch.float32)
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = True
    out = ops.grouped_linear(x, weight, scale, block)
    assert_matches(out, reference.grouped_linear(x, weight, scale, block), TOLERANCE[torch.float32])


@pytest.mark.parametrize("tokens,batch_invariant", [(7, False), (70, False), (7, True)])
def test_grouped_linear_takes_x_as_fp8_codes(tokens, batch_invariant):
    """x's codes and scales (`QuantizedActivations`, as the attention hands wo_a them) give the W8A8 launch's bits
    for x's values, on the backend's op and the kernel; the reference op multiplies their values, as it does x's."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 3, 128, generator=gen).to(torch.bfloat16)
    weight, scale = quantize_fp8_block(torch.randn(3 * 64, 128, generator=gen) / 8, (64, 64))
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = True
    ops.batch_invariant = reference.batch_invariant = batch_invariant
    assert ops.quantized_input_group(weight, (64, 64)) == 64
    assert reference.quantized_input_group(weight, (64, 64)) is None
    codes = QuantizedActivations(*quantize_fp8_activations(x.flatten(1), 64), 64, x.dtype).view(tokens, 3, 128)
    expected = ops.grouped_linear(x, weight, scale, (64, 64))
    assert torch.equal(ops.grouped_linear(codes, weight, scale, (64, 64)), expected)
    assert torch.equal(grouped_linear(codes.codes, weight, scale, (64, 64), batch_invariant, out_dtype=x.dtype,
                                      x_scales=codes.scales), expected)
    assert torch.equal(reference.grouped_linear(codes, weight, scale, (64, 64)),
                       reference.grouped_linear(x, weight, scale, (64, 64)))


def test_fp8_codes_of_x_need_a_weight_whose_k_blocks_are_mma_tiles():
    codes = torch.zeros(2, 1, 64).to(torch.float8_e4m3fn)
    weight, scale = quantize_fp8_block(torch.randn(32, 64), (32, 32))
    with pytest.raises(ValueError, match="fp8 codes of x"):
        grouped_linear(codes, weight, scale, (32, 32), out_dtype=torch.bfloat16, x_scales=torch.ones(2, 1, 2))


@pytest.mark.parametrize("tokens,group,num_sms,batch_invariant,in_epilogue", [
    (70, 64, None, False, True),  # W8A8 tiles of 64 columns, each one 64-column group: the launch stores the codes
    (70, 32, None, False, False),  # tiles of two groups: a quantisation launch follows
    (7, 64, 132, False, True),  # split K: the tile's last program to arrive stores them
    (7, 64, None, True, True),
])
def test_grouped_linear_stores_its_output_as_fp8_codes(monkeypatch, tokens, group, num_sms, batch_invariant,
                                                       in_epilogue):
    """With `out_group`, y's codes and scales are `quantize_fp8_rows`' of the launch's y (its rows of G * N), bit for
    bit, whether the launch stores them or a quantisation launch follows; from x's values or x's codes."""
    import deepinfer_kernels.linear as linear_module
    from deepinfer_kernels.activation_quant import quantize_fp8_rows

    gen = torch.Generator().manual_seed(tokens + group)
    x = torch.randn(tokens, 3, 512, generator=gen).to(torch.bfloat16)
    weight, scale = quantize_fp8_block(torch.randn(3 * 128, 512, generator=gen) / 8, (64, 64))
    y = grouped_linear(x, weight, scale, (64, 64), batch_invariant, num_sms, fp8_activations=True)
    expected = quantize_fp8_rows(y.view(tokens, -1), group)
    launches = []
    monkeypatch.setattr(linear_module, "quantize_fp8_rows", lambda *a: launches.append(1) or quantize_fp8_rows(*a))
    codes, scales = grouped_linear(x, weight, scale, (64, 64), batch_invariant, num_sms, fp8_activations=True,
                                   out_group=group)
    assert len(launches) == (1 if in_epilogue else 2)  # x's quantisation, then y's unless the launch stored it
    assert codes.shape == (tokens, 3, 128) and scales.shape == (tokens, 3 * 128 // group)
    assert torch.equal(codes.view(tokens, -1).view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(scales, expected[1])
    x_codes, x_scales = quantize_fp8_activations(x.flatten(1), 64)
    from_codes = grouped_linear(x_codes.view(x.shape), weight, scale, (64, 64), batch_invariant, num_sms,
                                out_dtype=x.dtype, x_scales=x_scales.view(tokens, 3, -1), out_group=group)
    assert torch.equal(from_codes[0].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(from_codes[1], scales)


@pytest.mark.parametrize("tokens,batch_invariant", [(70, False), (7, True)])
def test_the_output_projection_takes_the_grouped_projections_fp8_codes(tokens, batch_invariant):
    """wo_a's output as fp8 codes (`grouped_linear_quantized`) are the codes of its values, and wo_b's `linear` of
    them gives the bits of wo_b's `linear` of those values (W8A8), on the backend's ops; the reference op's codes
    are its own output's."""
    from deepinfer_kernels.activation_quant import quantize_fp8_rows

    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2, 128, generator=gen).to(torch.bfloat16)
    wo_a, wo_a_scale = quantize_fp8_block(torch.randn(2 * 128, 128, generator=gen) / 8, (64, 64))
    wo_b, wo_b_scale = quantize_fp8_block(torch.randn(96, 256, generator=gen) / 8, (64, 64))
    for ops in (TritonOps(), KernelOps()):
        ops.fp8_activations, ops.batch_invariant = True, batch_invariant
        y = ops.grouped_linear(x, wo_a, wo_a_scale, (64, 64)).flatten(1)
        codes = ops.grouped_linear_quantized(x, wo_a, wo_a_scale, (64, 64), 64)
        expected_codes, expected_scales = quantize_fp8_rows(y, 64)
        assert torch.equal(codes.codes.view(torch.uint8), expected_codes.view(torch.uint8))
        assert torch.equal(codes.scales, expected_scales) and codes.dtype == y.dtype
        assert torch.equal(ops.linear(codes, wo_b, wo_b_scale, (64, 64)), ops.linear(y, wo_b, wo_b_scale, (64, 64)))
    assert TritonOps().quantized_input_group(wo_b, (64, 64)) is None, "the codes are for W8A8 products only"


def test_grouped_codes_need_whole_groups_a_token():
    weight, scale = quantize_fp8_block(torch.randn(96, 64), (32, 32))
    for ops in (TritonOps(), KernelOps()):
        with pytest.raises(ValueError, match="splits 64-column groups"):
            ops.grouped_linear_quantized(torch.randn(2, 1, 64), weight, scale, (32, 32), 64)


def test_one_row_meeting_an_fp8_weight_of_whole_block_tiles_takes_cuda_core_tiles():
    """One row of x and an fp8 weight whose blocks hold the tile (W8A16) take one-row tiles (the kernel's
    CUDA-core sums); more rows, other weights, smaller blocks, fp8 activations and batch-invariant mode
    (tiles for BATCH_INVARIANT_ROWS whatever the rows) keep the MMA tiles (float32 rows: the test above)."""
    from deepinfer_kernels.linear import BATCH_INVARIANT_ROWS, one_row_tiles

    assert one_row_tiles(1, 1, (128, 128), False) and one_row_tiles(1, 1, (64, 128), False)
    others = [(2, 1, (128, 128), False), (1, 0, None, False), (1, 2, None, False), (1, 1, (32, 32), False),
              (1, 1, (128, 128), True), (BATCH_INVARIANT_ROWS, 1, (128, 128), False)]
    assert not any(one_row_tiles(*args) for args in others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(64, 128), (128, 256)])
@pytest.mark.parametrize("num_sms", [None, 132])
def test_one_row_fp8_matches_reference(dtype, block, num_sms):
    """One-row tiles: each K tile's block scale on x, K split in ranges (the partials' fixed-order sum) or
    not, one group and several."""
    gen = torch.Generator().manual_seed(block[0] + (num_sms or 0))
    weight, scale = quantize_fp8_block(torch.randn(3 * 128, 1024, generator=gen) / 8, block)
    assert split_k(6, 1024, 128, 132, fill=4, one_row=True) == 4
    x = torch.randn(1, 1024, generator=gen).to(dtype)
    assert_matches(linear(x, weight, scale, block, num_sms=num_sms), KernelOps().linear(x, weight, scale, block),
                   TOLERANCE[dtype])
    grouped = torch.randn(1, 3, 1024, generator=gen).to(dtype)
    assert_matches(grouped_linear(grouped, weight, scale, block, num_sms=num_sms),
                   KernelOps().grouped_linear(grouped, weight, scale, block), TOLERANCE[dtype])
