"""fp8 block-scaled and fp4 (MXFP4) weight formats of MODEL_SPEC §8: exact decoding, quantisation, round trips."""

import itertools
import math

import pytest
import torch

from deepinfer_core.quantization import (
    FP4_VALUES,
    QuantizationFormatError,
    dequantize_fp4,
    dequantize_fp8_block,
    fake_quantize_fp8_activations,
    quantize_fp4,
    quantize_fp8_block,
)


def e8m0(exponent_bytes) -> torch.Tensor:
    return torch.tensor(exponent_bytes, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def decode_e4m3_byte(byte: int) -> float:
    """e4m3fn by the book: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0x0F, byte & 0x07
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def random_e4m3_bytes(shape, generator) -> torch.Tensor:
    raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
    raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)  # 0x7F / 0xFF are NaN in e4m3fn
    return raw.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantisation_matches_the_byte_level_definition_exactly(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, cols, block = 5, 7, (2, 3)
    weight_bytes = random_e4m3_bytes((rows, cols), generator)
    scale_bytes = torch.randint(110, 145, (3, 3), generator=generator).tolist()
    expected = torch.tensor(
        [
            [
                decode_e4m3_byte(int(weight_bytes[i, j])) * 2.0 ** (scale_bytes[i // 2][j // 3] - 127)
                for j in range(cols)
            ]
            for i in range(rows)
        ],
        dtype=torch.float64,
    )
    result = dequantize_fp8_block(weight_bytes.view(torch.float8_e4m3fn), e8m0(scale_bytes), block, dtype)
    assert result.dtype == dtype
    # Exact: power-of-two scales times 4-bit significands fit both float32 and bfloat16.
    torch.testing.assert_close(result.double(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(130, 200), (64, 96), (257, 129)])
def test_fp8_quantisation_error_is_within_half_an_e4m3_step(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    weight, scale = quantize_fp8_block(w)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert tuple(scale.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    restored = dequantize_fp8_block(weight, scale, dtype=torch.float32)
    factor = scale.float().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # Round to nearest: relative error <= 2^-4 (3 mantissa bits) for normal values; the subnormal step is
    # 2^-9 of the scale, so half a step is 2^-10 of it.
    bound = torch.maximum(w.abs() * 2.0**-4, factor * 2.0**-10)
    assert ((restored - w).abs() <= bound).all()


def test_fp8_block_scale_is_the_smallest_power_of_two_that_avoids_saturation():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 384)
    _, scale = quantize_fp8_block(w)
    amax = w.abs().unflatten(0, (2, 128)).unflatten(2, (3, 128)).amax(dim=(1, 3))
    factor = scale.float()
    assert (amax <= 448 * factor).all()
    assert (amax > 448 * factor / 2).all()


def test_fp8_quantisation_of_a_dequantised_matrix_gives_back_the_same_bytes():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    weight, scale = quantize_fp8_block(w)
    again_weight, again_scale = quantize_fp8_block(dequantize_fp8_block(weight, scale, dtype=torch.float32))
    assert torch.equal(again_weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(again_scale.view(torch.uint8), scale.view(torch.uint8))


def test_fp8_all_zero_block_gets_the_smallest_scale_and_zero_values():
    w = torch.zeros(4, 4)
    weight, scale = quantize_fp8_block(w)
    assert scale.view(torch.uint8).tolist() == [[0]]
    assert torch.equal(dequantize_fp8_block(weight, scale, dtype=torch.float32), w)


def fp8_activation_rows(seed: int) -> torch.Tensor:
    """Rows with the cases the activation rounding must get right: a spread of magnitudes, an all-zero
    group, a group below the 1e-4 amax floor, an amax of exactly 448 * 2^-3 and one just above it."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 2, 256)
    x[1, :128] = 0
    x[2] *= 1e-7
    x[3, :128] = x[3, :128].clamp(-56, 56)
    x[3, 5] = 56.0
    x[4, :128] = x[4, :128].clamp(-56, 56)
    x[4, 7] = 56.000004
    return x


def test_fp8_activation_rounding_uses_the_smallest_scale_and_the_nearest_e4m3_value():
    x = fp8_activation_rows(0)
    rounded = fake_quantize_fp8_activations(x, 128)
    groups, out = x.unflatten(1, (2, 128)), rounded.unflatten(1, (2, 128))
    amax = groups.abs().amax(dim=-1).clamp(min=1e-4)
    exponent = torch.ceil(torch.log2(amax.double() / 448))
    assert exponent[3, 0] == -3 and exponent[4, 0] == -2  # 448 * 2^-3 = 56 exactly; 56.000004 needs the next
    scale = torch.exp2(exponent)[..., None]
    codes = (out.double() / scale).float()
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes), "not an e4m3 value times the scale"
    # nearest: within half an e4m3 step of x / scale (relative 2^-4 for normals, 2^-10 absolute below 2^-6)
    target = groups.double() / scale
    assert ((codes.double() - target).abs() <= torch.maximum(target.abs() * 2.0**-4, torch.tensor(2.0**-10))).all()
    assert (target.abs() <= 448).all() and (out[1, 0] == 0).all()


def test_fp8_activation_rounding_keeps_dtype_shape_and_a_ragged_last_group():
    x = torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rounded = fake_quantize_fp8_activations(x, 128)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == x.shape
    assert torch.equal(rounded[..., 128:], fake_quantize_fp8_activations(x[..., 128:].contiguous(), 128))


@pytest.mark.parametrize(
    ("packed", "scale_byte", "expected"),
    [
        (0x21, 127, [0.5, 1.0]),  # low nibble (column 0) = code 1, high nibble (column 1) = code 2
        (0x7A, 127, [-1.0, 6.0]),  # 0xA = -1.0, 0x7 = 6.0
        (0xF8, 127, [-0.0, -6.0]),  # 0x8 = -0, 0xF = -6
        (0x53, 128, [3.0, 6.0]),  # 1.5 and 3.0 times 2^1
        (0x64, 125, [0.5, 1.0]),  # 2.0 and 4.0 times 2^-2
    ],
)
def test_fp4_known_bytes(packed, scale_byte, expected):
    row = torch.tensor([[packed] + [0] * 15], dtype=torch.uint8).view(torch.int8)
    result = dequantize_fp4(row, e8m0([[scale_byte]]), torch.float32)
    assert result[0, :2].tolist() == expected
    assert (result[0, 2:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_dequantisation_matches_the_nibble_table_exactly(dtype):
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (3, 64), generator=generator)
    scale_bytes = torch.randint(115, 140, (3, 2), generator=generator)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    expected = [
        [FP4_VALUES[int(codes[i, k])] * 2.0 ** (int(scale_bytes[i, k // 32]) - 127) for k in range(64)]
        for i in range(3)
    ]
    result = dequantize_fp4(packed, e8m0(scale_bytes.tolist()), dtype)
    assert result.dtype == dtype
    assert result.double().tolist() == expected


def test_fp4_quantisation_picks_the_nearest_representable_value():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(5)) * 2
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (16, 48)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (16, 3)
    restored = dequantize_fp4(packed, scale, torch.float32)
    factor = scale.float().repeat_interleave(32, dim=1)
    grid = torch.tensor(FP4_VALUES)[None, None, :] * factor[..., None]
    nearest_distance = (w[..., None] - grid).abs().amin(dim=-1)
    torch.testing.assert_close((restored - w).abs(), nearest_distance, rtol=0, atol=0)
    amax = w.abs().unflatten(1, (3, 32)).amax(dim=-1)
    assert (amax <= 6 * scale.float()).all() and (amax > 3 * scale.float()).all()


def test_fp4_ties_round_to_the_even_code():
    # A block whose amax is 6 gets scale 1; each value sits exactly between two e2m1 magnitudes.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = torch.tensor([ties + [-t for t in ties] + [6.0] + [0.0] * 17])
    packed, scale = quantize_fp4(row)
    assert scale.view(torch.uint8).tolist() == [[127]]
    restored = dequantize_fp4(packed, scale, torch.float32)[0].tolist()
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert restored[:7] == expected
    assert restored[7:14] == [-v for v in expected]


def test_fp4_round_trip_is_stable():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    once = dequantize_fp4(*quantize_fp4(w), torch.float32)
    twice = dequantize_fp4(*quantize_fp4(once), torch.float32)
    assert torch.equal(once, twice)


def test_fp4_packing_puts_even_columns_in_the_low_nibble():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 0.5, -6.0  # codes 1 and 15 with scale 1
    packed, scale = quantize_fp4(w)
    assert scale.view(torch.uint8).tolist() == [[127]]
    assert packed.view(torch.uint8)[0, 0].item() == 0xF1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: dequantize_fp8_block(torch.zeros(4, 4), e8m0([[127]])), "float8_e4m3fn"),
        (lambda: dequantize_fp8_block(torch.zeros(4, 4).to(torch.float8_e4m3fn), e8m0([[127, 127]])), "shape"),
        (lambda: dequantize_fp4(torch.zeros(2, 16, dtype=torch.uint8), e8m0([[127], [127]])), "int8"),
        (lambda: dequantize_fp4(torch.zeros(2, 16, dtype=torch.int8), e8m0([[127, 127]])), "shape"),
        (lambda: quantize_fp4(torch.randn(2, 40)), "multiple of 32"),
        (lambda: quantize_fp8_block(torch.randn(2, 3, 4)), "2-D"),
    ],
    ids=["fp8-dtype", "fp8-scale-shape", "fp4-dtype", "fp4-scale-shape", "fp4-width", "fp8-rank"],
)
def test_malformed_inputs_are_rejected_with_the_reason(call, message):
    with pytest.raises(QuantizationFormatError, match=message):
        call()


def test_every_e4m3_byte_decodes_like_the_definition():
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    weight = torch.tensor([finite], dtype=torch.uint8).view(torch.float8_e4m3fn)
    result = dequantize_fp8_block(weight, e8m0([[127, 127]]), (1, 128), torch.float32)
    assert result[0].tolist() == [decode_e4m3_byte(b) for b in finite]


def test_fp4_table_is_e2m1():
    magnitudes = [(1 + m / 2) * 2.0 ** (e - 1) if e else m / 2 for e, m in itertools.product(range(4), range(2))]
    assert list(FP4_VALUES[:8]) == magnitudes
    assert list(FP4_VALUES[8:]) == [-v for v in magnitudes]
