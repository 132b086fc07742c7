"""Triton `dequantize_weight` (fp8 block-scaled weights widened in one pass) against the reference op, bit for bit,
through the interpreter; and the backend's choice of it."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from deepinfer_nvidia.ops import TritonOps

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import QuantizationFormatError, quantize_fp8_block
from deepinfer_kernels.weight_dequant import dequantize_fp8_weight, fp8_weight_supported


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, NaN where the reference has NaN (a NaN's sign and payload are the multiply's to pick)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan].signbit(), want[~nan].signbit())


def _weight(gen: torch.Generator, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    weight, _ = quantize_fp8_block(torch.randn(n, k, generator=gen) * 3, block)
    return weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,block", [(70, 200, (32, 64)), (128, 256, (128, 128)), (33, 17, (16, 16))])
def test_every_scale_byte_gives_the_reference_bits(n, k, block, dtype):
    """Scale bytes over the whole e8m0 range, 0 (2^-127, subnormal products) and 255 (NaN) included; fp16 overflows
    to inf where the reference does."""
    gen = torch.Generator().manual_seed(n + k)
    weight = _weight(gen, n, k, block)
    blocks = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.randint(0, 256, blocks, generator=gen, dtype=torch.uint8)
    scale.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    _same_bits(dequantize_fp8_weight(weight, scale, block, dtype), KernelOps().dequantize_weight(weight, scale, block, dtype))


def test_a_row_slice_of_a_wider_stack_is_read_in_place():
    """Rows of unit column stride but a longer row stride (a column slice of a stacked weight) need no copy."""
    gen = torch.Generator().manual_seed(3)
    wide, scale = quantize_fp8_block(torch.randn(64, 256, generator=gen), (32, 32))
    weight, part = wide[:, 64:160], scale[:, 2:5]
    assert fp8_weight_supported(weight, part, (32, 32), torch.bfloat16)
    _same_bits(TritonOps().dequantize_weight(weight, part, (32, 32), torch.bfloat16),
               KernelOps().dequantize_weight(weight, part, (32, 32), torch.bfloat16))


def test_the_backend_leaves_other_weights_to_the_reference():
    """Dense, fp4 and transposed fp8 weights are the reference's; a scale of the wrong shape gets its error."""
    gen = torch.Generator().manual_seed(4)
    weight, scale = quantize_fp8_block(torch.randn(64, 128, generator=gen), (32, 32))
    assert not fp8_weight_supported(weight.t(), scale.t(), (32, 32), torch.bfloat16)
    assert not fp8_weight_supported(weight, scale, None, torch.bfloat16)
    assert not fp8_weight_supported(weight.to(torch.bfloat16), None, None, torch.bfloat16)
    _same_bits(TritonOps().dequantize_weight(weight.t(), scale.t(), (32, 32), torch.float32),
               KernelOps().dequantize_weight(weight.t(), scale.t(), (32, 32), torch.float32))
    with pytest.raises(QuantizationFormatError, match="must have shape"):
        TritonOps().dequantize_weight(weight, scale[:, :3], (32, 32), torch.bfloat16)
