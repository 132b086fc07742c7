"""Triton fp8 activation quantisation (`activation_quant.quantize_fp8_rows`, and `fake_quantize_fp8_rows` behind the
backend's `fake_quantize_activations`) against its definition, `quantization.fake_quantize_fp8_activations`: bit for
bit."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from test_quantization import fp8_activation_rows

from deepinfer_nvidia.ops import TritonOps

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import fake_quantize_fp8_activations, quantize_fp8_block
from deepinfer_kernels.activation_quant import fake_quantize_fp8_rows, quantize_fp8_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_codes_times_scales_are_the_reference_rounding_exactly(dtype, group):
    x = fp8_activation_rows(group)[:, :200].to(dtype)  # 200 columns: a ragged last group
    codes, scales = quantize_fp8_rows(x, group)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (6, -(-200 // group))
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round())), "scales must be powers of two"
    restored = codes.float() * scales.repeat_interleave(group, dim=1)[:, :200]
    assert torch.equal(restored.to(dtype), fake_quantize_fp8_activations(x, group))


def test_rows_are_read_with_their_stride():
    x = torch.randn(5, 2, 128, generator=torch.Generator().manual_seed(1))[:, 1]
    codes, scales = quantize_fp8_rows(x, 128)
    assert torch.equal(codes.float() * scales, fake_quantize_fp8_activations(x, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_fake_quantized_rows_are_the_reference_rounding_exactly(dtype, group):
    x = fp8_activation_rows(group)[:, :200].to(dtype)
    got = fake_quantize_fp8_rows(x, group)
    assert got.dtype == dtype and torch.equal(got, fake_quantize_fp8_activations(x, group))


@pytest.mark.parametrize("group", [16, 32, 256])
def test_rows_and_columns_past_one_program_tile(group):
    """70 rows (five row tiles, past SEGMENT_ROWS) of 600 columns: several column tiles, the last ending inside a
    group."""
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(70, 600, generator=gen) * torch.exp2(torch.randint(-12, 12, (70, 1), generator=gen).float())
    codes, scales = quantize_fp8_rows(x, group)
    restored = codes.float() * scales.repeat_interleave(group, dim=1)[:, :600]
    assert torch.equal(restored, fake_quantize_fp8_activations(x, group))
    assert torch.equal(fake_quantize_fp8_rows(x.to(torch.bfloat16), group),
                       fake_quantize_fp8_activations(x.to(torch.bfloat16), group))


def _fp8_weight(k: int, block: tuple[int, int]) -> torch.Tensor:
    weight, _ = quantize_fp8_block(torch.randn(64, k, generator=torch.Generator().manual_seed(2)), block)
    return weight


def test_backend_rounds_what_the_reference_rounds_and_nothing_else():
    """Under `fp8_activations` the backend's op gives the reference's bits for a [2, 3, K] x; without the flag, or
    for a dense weight, x comes back untouched, as from the reference."""
    x = fp8_activation_rows(32)[:, :96].reshape(2, 3, 96).to(torch.bfloat16)
    ops, reference = TritonOps(), KernelOps()
    ops.fp8_activations = reference.fp8_activations = True
    weight = _fp8_weight(96, (32, 32))
    got = ops.fake_quantize_activations(x, weight, (32, 32))
    assert got.shape == x.shape and torch.equal(got, reference.fake_quantize_activations(x, weight, (32, 32)))
    assert not torch.equal(got, x), "the rows must need rounding for this test to mean anything"
    assert ops.fake_quantize_activations(x, weight.to(torch.bfloat16), None) is x
    ops.fp8_activations = False
    assert ops.fake_quantize_activations(x, weight, (32, 32)) is x
