"""The nvidia backend's batched decode `compress_kv` against the reference op's per-sequence loop."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (makes the in-tree backends importable)

import pytest
import torch

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.op_cases import _step_batch
from deepinfer_nvidia.decode_compress import compress_kv_decode, is_decode_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_decode_compress_matches_reference(dtype, ratio, overlap):
    gen = torch.Generator().manual_seed(ratio)
    width, block_size, num_blocks, num_slots = 16, 16, 40, 8
    # contexts that close a window (ctx+1 divisible by ratio), the first window, and open windows
    contexts = [ratio - 1, 2 * ratio - 1, 0, 5, 3 * ratio + 1, 7 * ratio - 1]
    batch = _step_batch(gen, [1] * len(contexts), contexts, num_slots, blocks_per_seq=4, num_blocks=num_blocks)
    assert is_decode_step(batch)
    proj, span = (2 * width, 2 * ratio) if overlap else (width, ratio)
    kv, gate = (torch.randn(len(contexts), proj, generator=gen).to(dtype) for _ in range(2))
    ape = torch.randn(ratio, proj, generator=gen) * 0.5
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    state = [torch.randn(num_slots, span, proj, generator=gen).to(dtype) for _ in range(2)]
    entries = torch.randn(num_blocks, block_size // ratio, width, generator=gen).to(dtype)
    fixed = (ape, torch.rand(width, generator=gen) + 0.5, 1e-6, inv_freq, ratio, overlap)

    expected = [t.clone() for t in (*state, entries)]
    KernelOps().compress_kv(kv, gate, *fixed, *expected, batch)
    got = [t.clone() for t in (*state, entries)]
    compress_kv_decode(KernelOps(), kv, gate, *fixed, *got, batch)

    # states are copies (exact); entries go through the same ops on a batched shape (float32 sums may
    # reorder by a few ulps; bf16 adds the output rounding)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2], rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)
    assert not torch.equal(expected[2], entries), "no window closed: the case would not test emission"
