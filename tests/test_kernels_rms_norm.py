"""Triton `rms_norm` against `KernelOps.rms_norm` through the interpreter."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels.rms_norm import rms_norm

# float32: summation order only (~1e-7). bfloat16: one output rounding, the same on both sides up to
# a rare 1-ulp flip where the float32 values straddle a bf16 midpoint (~4e-3 relative in norm).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,weighted", [((5, 3, 97), True), ((13, 200), False), ((1, 1024 + 7), True)])
def test_rms_norm_matches_reference(dtype, shape, weighted):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=gen) + 0.5 if weighted else None
    assert_matches(rms_norm(x, weight, 1e-6), KernelOps().rms_norm(x, weight, 1e-6), TOLERANCE[dtype])


def test_rms_norm_reads_strided_rows():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 2, 48, generator=gen).to(torch.bfloat16)[:, 1]
    weight = torch.rand(48, generator=gen) + 0.5
    assert_matches(rms_norm(x, weight, 1e-6), KernelOps().rms_norm(x, weight, 1e-6), TOLERANCE[torch.bfloat16])
