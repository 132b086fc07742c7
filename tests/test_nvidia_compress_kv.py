"""The nvidia backend's `compress_kv` kernels (decode and mixed steps) against the reference op's per-sequence loop."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.op_cases import _step_batch
from deepinfer_kernels.compress_kv import compress_kv, is_decode_step


def _closed_entries(contexts: list[int], tables: torch.Tensor, ratio: int, block_size: int) -> set[tuple[int, int]]:
    """(block, offset) of the entries the step's closing tokens write."""
    closed = set()
    for i, ctx in enumerate(contexts):
        if (ctx + 1) % ratio == 0:
            first = ctx // ratio * ratio
            closed.add((int(tables[i, first // block_size]), (first % block_size) // ratio))
    return closed


def _inputs(gen, dtype, ratio, overlap, width, rows, num_slots, num_blocks, block_size):
    proj, span = (2 * width, 2 * ratio) if overlap else (width, ratio)
    kv, gate = (torch.randn(rows, proj, generator=gen).to(dtype) for _ in range(2))
    ape = torch.randn(ratio, proj, generator=gen) * 0.5
    # 4 rotated pairs: the leading width - 8 channels are only normalised
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    state = [torch.randn(num_slots, span, proj, generator=gen).to(dtype) for _ in range(2)]
    entries = torch.randn(num_blocks, block_size // ratio, width, generator=gen).to(dtype)
    fixed = (ape, torch.rand(width, generator=gen) + 0.5, 1e-6, inv_freq, ratio, overlap)
    return kv, gate, fixed, state, entries


def _run_both(kv, gate, fixed, state, entries, batch):
    expected = [t.clone() for t in (*state, entries)]
    KernelOps().compress_kv(kv, gate, *fixed, *expected, batch)
    got = [t.clone() for t in (*state, entries)]
    compress_kv(kv, gate, *fixed, *got, batch)
    return got, expected


def _assert_matches(got, expected, dtype):
    # states are copies (exact); entries: the kernel's exp / cos / sin and sum order differ from torch's
    # by float32 ulps, which bf16 roundings of probabilities and outputs can turn into one bf16 ulp
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2], rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)


# (ratio, overlap, width): widths 16 pool in one chunk of slots; width 256 gives 16-slot chunks, so the
# 32 slots of ratio 32 and of ratio 16 with overlap take two (for the latter the first chunk holds only
# the previous window's slots, absent for window 0).
CONFIGS = [(4, True, 16), (8, False, 16), (16, True, 256), (32, False, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap,width", CONFIGS)
def test_decode_compress_matches_reference(dtype, ratio, overlap, width):
    gen = torch.Generator().manual_seed(ratio)
    block_size, num_blocks, num_slots = 2 * ratio, 40, 8
    # contexts that close a window (ctx+1 divisible by ratio; window 0 among them), and open windows
    contexts = [ratio - 1, 2 * ratio - 1, 0, 5, 3 * ratio + 1, 7 * ratio - 1]
    batch = _step_batch(gen, [1] * len(contexts), contexts, num_slots, blocks_per_seq=4, num_blocks=num_blocks)
    assert is_decode_step(batch)
    kv, gate, fixed, state, entries = _inputs(gen, dtype, ratio, overlap, width, len(contexts), num_slots,
                                              num_blocks, block_size)
    got, expected = _run_both(kv, gate, fixed, state, entries, batch)
    _assert_matches(got, expected, dtype)
    closed = _closed_entries(contexts, batch.block_tables, ratio, block_size)
    assert len(closed) == 3, "the case must close three windows, window 0 among them"
    untouched = torch.ones(entries.shape[:2], dtype=torch.bool)
    for block, offset in closed:
        untouched[block, offset] = False
        assert not torch.equal(got[2][block, offset], entries[block, offset]), "a closed window was not written"
    assert torch.equal(got[2][untouched], entries[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap,width", CONFIGS)
def test_mixed_step_compress_matches_reference(dtype, ratio, overlap, width):
    """Fresh prefills, continued chunks whose first windows read the state (and replace state rows those
    windows read: the states must be written after the pooling), steps longer than the state's span, a
    step closing no window, and decodes."""
    gen = torch.Generator().manual_seed(100 + ratio)
    block_size, num_blocks, num_slots = 2 * ratio, 64, 8
    query_lens = [5 * ratio + 3, 3 * ratio, 2, ratio // 2, 1, 1]
    contexts = [0, ratio + 1, 2 * ratio - 1, ratio, 4 * ratio - 1, 3]
    batch = _step_batch(gen, query_lens, contexts, num_slots, blocks_per_seq=8, num_blocks=num_blocks)
    kv, gate, fixed, state, entries = _inputs(gen, dtype, ratio, overlap, width, sum(query_lens), num_slots,
                                              num_blocks, block_size)
    got, expected = _run_both(kv, gate, fixed, state, entries, batch)
    _assert_matches(got, expected, dtype)
    assert not torch.equal(expected[2], entries), "the case must write entries"


def test_decode_compress_rejects_float8_entries():
    # Triton's float8 casts saturate where torch's `.to(torch.float8_e4m3fn)` does not: no silent mismatch
    state = torch.zeros(1, 4, 8)
    entries = torch.zeros(2, 1, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="entries dtype torch.float8_e4m3fn"):
        compress_kv(
            torch.ones(1, 8), torch.ones(1, 8), torch.ones(4, 8), torch.ones(8), 1e-6, torch.ones(2), 4, False,
            state, state.clone(), entries, _step_batch(torch.Generator(), [1], [0], 1, blocks_per_seq=1, num_blocks=2),
        )
