"""The V4.1 KV formats (MODEL_SPEC_V41 §5) against straightforward scalar formulas, tie rules included."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.models.deepseek_v41 import DeepseekV41Cache, parse_deepseek_v41_config
from deepinfer_core.models.deepseek_v41.kv_quant import KvQuantizer, StoredTensor, kv_formats
from deepinfer_core.platform.kernel_ops import KernelOps

OPS = KernelOps()
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _nearest(value: float, grid: list[tuple[float, int]]) -> float:
    """Round to the nearest grid value; a tie goes to the even code."""
    best = min(grid, key=lambda vc: (abs(vc[0] - value), vc[1] % 2))
    return best[0]


_E4M3_GRID = [(float(v), c) for c, v in enumerate(E4M3_VALUES.tolist()) if math.isfinite(v)]
_E2M1_SIGNED = [(v, c) for c, v in enumerate(E2M1_GRID)] + [(-v, c) for c, v in enumerate(E2M1_GRID)]


def _ceil_log2(v: float) -> int:
    mantissa, exponent = math.frexp(v)
    return exponent - 1 if mantissa == 0.5 else exponent


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _fp8_reference(x: torch.Tensor) -> torch.Tensor:
    out = []
    for block in x.view(-1, 32).tolist():
        amax = max(max(abs(v) for v in block), 1e-4)
        s = 2.0 ** _ceil_log2(_f32(_f32(amax) * _f32(1 / 448)))
        out.append([_nearest(max(-448.0, min(448.0, _f32(v / s))), _E4M3_GRID) * s for v in block])
    return torch.tensor(out).view(x.shape)


def _fp4_reference(x: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    out = []
    for values in x.view(-1, block).tolist():
        amax = max(abs(v) for v in values)
        if scale_format == "e4m3":
            s = _nearest(_f32(max(amax, 6 * 2.0**-9) / 6), _E4M3_GRID)
        else:
            s = 2.0 ** _ceil_log2(_f32(_f32(max(amax, 6 * 2.0**-126)) * _f32(1 / 6)))
        out.append([_nearest(max(-6.0, min(6.0, _f32(v / s))), _E2M1_SIGNED) * s for v in values])
    return torch.tensor(out).view(x.shape)


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    # spread magnitudes over many binades so scales differ per block
    return torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 6, shape[:-1] + (1,), generator=gen).float())


def test_fp8_window_format_matches_scalar_formula() -> None:
    x = _random(torch.Generator().manual_seed(0), 6, 64)
    values, exponents = OPS.fp8_block_quantize(x)
    assert values.dtype == torch.float8_e4m3fn and exponents.shape == (6, 2)
    torch.testing.assert_close(OPS.fp8_block_dequantize(values, exponents, torch.float32), _fp8_reference(x), rtol=0, atol=0)


def test_fp8_ties_round_to_even_and_tiny_blocks_use_the_floor_scale() -> None:
    # amax 300 gives scale 1; 1.0625 and 1.1875 sit halfway between e4m3 neighbours
    block = torch.tensor([300.0, 1.0625, 1.1875, -1.0625, 2.0625] + [0.5] * 27)
    tiny = torch.full((32,), 1e-7)  # amax floor 1e-4 -> scale 2^-22
    x = torch.stack([block, tiny])
    out = OPS.fp8_block_dequantize(*OPS.fp8_block_quantize(x), torch.float32)
    assert out[0, :5].tolist() == [288.0, 1.0, 1.25, -1.0, 2.0]
    torch.testing.assert_close(out, _fp8_reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("block,scale_format", [(16, "e4m3"), (32, "ue8m0")])
def test_fp4_formats_match_scalar_formula(block: int, scale_format: str) -> None:
    x = _random(torch.Generator().manual_seed(1), 5, 64)
    packed, scales = OPS.fp4_block_quantize(x, block, scale_format)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32) and scales.shape == (5, 64 // block)
    expected = _fp4_reference(x, block, scale_format)
    torch.testing.assert_close(OPS.fp4_block_dequantize(packed, scales, torch.float32), expected, rtol=0, atol=0)


def test_fp4_ties_follow_the_even_code_rule_and_packing_is_low_nibble_first() -> None:
    # amax 6 gives a ue8m0 scale of 1, so the block's values are the e2m1 inputs themselves
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = torch.tensor([6.0] + ties + [-t for t in ties] + [0.0] * 17)
    packed, scales = OPS.fp4_block_quantize(row[None], 32, "ue8m0")
    out = OPS.fp4_block_dequantize(packed, scales, torch.float32)[0]
    assert out[1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert out[8:15].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert int(scales[0, 0]) == 127
    assert int(packed[0, 0]) == 7 | (0 << 4)  # channel 0 (6.0, code 7) low, channel 1 (0.25 -> 0) high
    assert int(packed[0, 1]) == 2 | (2 << 4)  # 0.75 -> 1.0 (code 2), 1.25 -> 1.0


def test_quantizer_switch_and_indivisible_widths_pass_through() -> None:
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    off = KvQuantizer(OPS, kv_formats(48, 48, "bf16"))
    on = KvQuantizer(OPS, kv_formats(48, 48, "fp8_fp4"))
    for quantizer in (off, on):
        assert torch.equal(quantizer.window(x), x)  # 48 is not a multiple of 32
        assert torch.equal(quantizer.index(x), x)
    assert torch.equal(off.entry(x), x) and not torch.equal(on.entry(x), x)  # 48 = 3 blocks of 16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_formats(64, 32, "fp8")


def test_cache_stores_codes_that_decode_to_the_quantised_values() -> None:
    formats = kv_formats(64, 32, "fp8_fp4")
    gen = torch.Generator().manual_seed(5)
    for fmt, width, dtypes in ((formats.window, 64, (torch.float8_e4m3fn, torch.uint8)),
                               (formats.entry, 64, (torch.uint8, torch.float8_e4m3fn)),
                               (formats.index, 32, (torch.uint8, torch.uint8))):
        stored = StoredTensor(fmt, (4, 3), width, torch.float32, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        assert tuple(p.dtype for p in stored.parts) == dtypes
        x = _random(gen, 2, width)
        index = (torch.tensor([3, 1]), torch.tensor([2, 0]))
        stored.write(OPS, index, x)
        expected = KvQuantizer(OPS, formats)._roundtrip(fmt, x)
        assert torch.equal(stored.read(OPS, index), expected)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_fp4", "bf16"])
def test_paged_reads_equal_indexing_each_part(kv_cache_dtype) -> None:
    """A read gathers its vectors inside the decode: the same values as indexing every part first, for the
    reads the model makes (a ring's slots, leaving the window dim whole; entries by block and offset)."""
    formats = kv_formats(64, 32, kv_cache_dtype)
    gen = torch.Generator().manual_seed(6)
    for fmt in (formats.window, formats.entry, formats.index):
        width = 32 if fmt is formats.index else 64
        stored = StoredTensor(fmt, (5, 4), width, torch.float32, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        stored.write(OPS, (torch.arange(5).repeat_interleave(4), torch.arange(4).repeat(5)), _random(gen, 20, width))
        for index in ((torch.tensor([3, 0, 3]),), (torch.tensor([[4, 1], [1, 1]]), torch.tensor([[0, 3], [3, 2]]))):
            expected = fmt.decode(OPS, tuple(part[index] for part in stored.parts), torch.float32)
            assert torch.equal(stored.read(OPS, index), expected)


def test_release_layout_stores_890_bytes_of_global_kv_per_token() -> None:
    config = parse_deepseek_v41_config({"text_config": {"num_hidden_layers": 40}})
    # MODEL_SPEC_V41 §5: 3 pooled bands x (288 + 68) / 2 + 1 unpooled band x (288 + 68)
    assert DeepseekV41Cache.bytes_per_block(config, 2, torch.bfloat16) == 2 * 890
    unquantised = DeepseekV41Cache.bytes_per_block(config, 2, torch.bfloat16, kv_cache_dtype="bf16")
    assert unquantised == 2 * (3 * (512 + 128) * 2 // 2 + (512 + 128) * 2)
    window_bytes = 512 + 16  # e4m3 values + one ue8m0 byte per 32 channels
    assert DeepseekV41Cache.bytes_per_slot(config, torch.bfloat16) == 40 * 128 * window_bytes + 3 * 2 * 2 * 512 * 4


def test_model_refuses_a_cache_of_another_kv_dtype() -> None:
    from v41_fixtures import Runner, model

    runner = Runner(model("b_mixed_ratios", "fp8_fp4"))
    runner.model = model("b_mixed_ratios", "bf16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        runner.step({0: torch.tensor([0, 5, 6])})
