"""Triton `engram_gate` (DeepSeek-V4.1's Engram injection) against the reference op."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels.engram_gate import engram_gate

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_gate_matches_reference_on_the_models_views(dtype):
    """key and value as the model passes them: row-strided views of one projection's output; a width that is
    not a power of two; a zero stream row (its dot is a signed zero)."""
    gen = torch.Generator().manual_seed(4)
    t, n, d = 9, 3, 40
    streams = torch.randn(t, n, d, generator=gen).to(dtype)
    streams[2, 1] = 0.0
    kv = torch.randn(t, n * d + d, generator=gen).to(dtype)
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d:]
    q_weight, k_weight = (torch.rand(n, d, generator=gen) + 0.5).to(dtype), torch.randn(n, d, generator=gen).to(dtype)
    out = engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    expected = KernelOps().engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    assert out.dtype == streams.dtype
    assert_matches(out, expected, TOLERANCE[dtype])
    plain = (streams.float() + value.float().unsqueeze(1)).to(dtype)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-3)  # the gate is not 1
