"""Triton `rms_norm` and `latent_norms` against the reference ops through the interpreter."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels.rms_norm import latent_norms, rms_norm
from deepinfer_kernels.rope import rope

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


def _latent_inputs(gen, tokens, dq, dkv, rope_half, dtype):
    """(q_lora, q_weight, kv_latent, kv_weight, eps, positions, inv_freq), the latents as column views of one
    projection's output, as `LinearGroup` gives them."""
    both = (torch.randn(tokens, dq + dkv + 5, generator=gen) * 3).to(dtype)
    q_weight, kv_weight = torch.rand(dq, generator=gen) + 0.5, torch.rand(dkv, generator=gen) + 0.5
    positions = torch.randint(0, 70000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(rope_half, dtype=torch.float32) / rope_half))
    return both[:, :dq], q_weight, both[:, dq:dq + dkv], kv_weight, 1e-6, positions, inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,dq,dkv,rope_half", [(1, 64, 32, 4), (7, 96, 40, 8), (3, 48, 16, 8)])
def test_latent_norms_equal_the_norms_then_rope(dtype, tokens, dq, dkv, rope_half):
    """One launch gives the bits of the two `rms_norm` launches then `rope` (and matches the reference ops);
    odd widths (96, 40) leave masked columns, (3, 48, 16, 8) rotates the whole KV vector."""
    args = _latent_inputs(torch.Generator().manual_seed(tokens * dq + dkv), tokens, dq, dkv, rope_half, dtype)
    q_lora, q_weight, kv_latent, kv_weight, eps, positions, inv_freq = args
    q_latent, kv = latent_norms(*args)
    assert torch.equal(q_latent, rms_norm(q_lora, q_weight, eps))
    assert torch.equal(kv, rope(rms_norm(kv_latent, kv_weight, eps), positions, inv_freq))
    for out, ref in zip((q_latent, kv), KernelOps().latent_norms(*args)):
        assert_matches(out, ref, TOLERANCE[dtype])


def test_latent_norms_of_no_rows():
    args = _latent_inputs(torch.Generator().manual_seed(0), 0, 64, 32, 4, torch.bfloat16)
    q_latent, kv = latent_norms(*args)
    assert q_latent.shape == (0, 64) and kv.shape == (0, 32)
