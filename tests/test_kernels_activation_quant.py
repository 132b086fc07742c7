"""Triton fp8 activation quantisation (`activation_quant.quantize_fp8_rows`) against its definition,
`quantization.fake_quantize_fp8_activations`: bit for bit."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from test_quantization import fp8_activation_rows

from deepinfer_core.quantization import fake_quantize_fp8_activations
from deepinfer_kernels.activation_quant import quantize_fp8_rows


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
