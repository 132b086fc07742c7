"""Triton `rope`, `indexer_topk`, `store_window`, `gather_rows` and V4.1's fp4 KV decode against the reference
ops, through the interpreter.

Inputs are the conformance cases' (random mixed prefill + decode steps over a paged cache), plus an
indexer step with more entries than one tile and queries spanning several query tiles.
"""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.platform.op_cases import OP_CASES
from deepinfer_kernels.cache_writes import store_window
from deepinfer_kernels.fp4_decode import fp4_block_dequantize
from deepinfer_kernels.indexer import indexer_topk
from deepinfer_kernels.rope import rope
from deepinfer_kernels.row_gather import gather_rows

# rope: cos/sin rounded to the dtype on both sides; float32 differs by libm ulps, bf16 by a rare flip.
ROPE_TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def _case_inputs(op: str, name: str, dtype: torch.dtype):
    case = next(c for c in OP_CASES if c.op == op and c.name == name)
    return case.make_inputs(torch.Generator().manual_seed(11), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["forward", "inverse"])
def test_rope_matches_reference(dtype, name):
    args, _ = _case_inputs("rope", name, dtype)
    assert_matches(rope(*args), KernelOps().rope(*args), ROPE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_rotates_only_the_trailing_channels_of_x(dtype):
    args, kwargs = _case_inputs("rope", "inplace_permitted", dtype)
    x = args[0]
    expected = KernelOps().rope(*args, **kwargs)
    leading = x[..., :-8].clone()
    out = rope(*args, **kwargs)
    assert out.data_ptr() == x.data_ptr(), "not rotated in place"
    assert torch.equal(out[..., :-8], leading)
    assert_matches(out, expected, ROPE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_window_matches_reference(dtype):
    (kv, window, batch), _ = _case_inputs("store_window", "mixed_step", dtype)
    expected = window.clone()
    KernelOps().store_window(kv, expected, batch)
    store_window(kv, window, batch)
    assert torch.equal(window, expected)


def test_indexer_topk_matches_reference_on_conformance_step():
    args, _ = _case_inputs("indexer_topk", "mixed_step", torch.float32)
    assert torch.equal(indexer_topk(*args), KernelOps().indexer_topk(*args))


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_matches_reference_across_tiles(dtype, batch_invariant):
    from deepinfer_core.platform.op_cases import _step_batch

    gen = torch.Generator().manual_seed(5)
    ratio, block_size, topk = 4, 16, 9
    # one long prefill (3 query tiles of 64 rows or 9 of 16, 167 entries: 2 entry tiles), a continued
    # prefill and two decodes
    query_lens, context_lens = [140, 7, 1, 1], [530, 13, 301, 2]
    batch = _step_batch(gen, query_lens, context_lens, 4, blocks_per_seq=44, num_blocks=180)
    keys = torch.randn(180, block_size // ratio, 16, generator=gen).to(dtype)
    q = torch.randn(batch.num_tokens, 8, 16, generator=gen).to(dtype)
    weights = torch.randn(batch.num_tokens, 8, generator=gen).to(dtype)
    out = indexer_topk(q, weights, keys, ratio, topk, batch, batch_invariant)
    ref = KernelOps().indexer_topk(q, weights, keys, ratio, topk, batch)
    # bf16 products are exact in float32, so both sides sum the same terms; only the order differs,
    # which can swap two entries whose scores agree to ~1e-7: compare sets, and order where scores differ
    assert torch.equal(out.sort(dim=-1).values, ref.sort(dim=-1).values)
    assert (out == ref).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_decode_step_matches_reference_with_ties(dtype):
    """Decode steps take their own score kernel (all heads in one product) and the rank kernel.
    Repeated keys tie exactly, and zero keys score 0 (-0.0 where every head weight is negative): the
    ties must go to the lowest entry, and the top-k spans several 64-entry score tiles."""
    from deepinfer_core.platform.op_cases import _step_batch

    gen = torch.Generator().manual_seed(9)
    ratio, block_size, topk = 4, 16, 40
    batch = _step_batch(gen, [1] * 5, [301, 2, 57, 130, 499], 6, blocks_per_seq=32, num_blocks=170)
    keys = torch.randn(170, block_size // ratio, 16, generator=gen)
    keys[3::5] = keys[2::5]  # whole pages repeated: equal scores
    keys[7::11] = 0.0
    keys = keys.to(dtype)
    q = torch.randn(batch.num_tokens, 8, 16, generator=gen).to(dtype)
    weights = torch.randn(batch.num_tokens, 8, generator=gen)
    weights[1] = -weights[1].abs()
    weights = weights.to(dtype)
    out = indexer_topk(q, weights, keys, ratio, topk, batch)
    assert torch.equal(out, KernelOps().indexer_topk(q, weights, keys, ratio, topk, batch))


def test_indexer_topk_under_a_graph_bound_equals_exact_sizes():
    """A captured decode step sizes the scores from `max_seq_len`, not the host context lengths; reading
    those lists would bake one step's values into every replay, so here they raise."""
    from dataclasses import replace

    from deepinfer_core.platform.op_cases import _step_batch

    gen = torch.Generator().manual_seed(8)
    ratio, topk = 4, 7
    batch = _step_batch(gen, [1, 1, 1], [57, 3, 130], 3, blocks_per_seq=12, num_blocks=40)
    keys = torch.randn(40, 4, 16, generator=gen)
    q, weights = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 8, generator=gen)
    exact = indexer_topk(q, weights, keys, ratio, topk, batch)

    class Unreadable(list):
        def __iter__(self):
            raise AssertionError("read a host list")

    bounded = replace(batch, max_seq_len=256, context_lens_cpu=Unreadable(), block_tables_cpu=Unreadable())
    assert torch.equal(indexer_topk(q, weights, keys, ratio, topk, bounded), exact)


@pytest.mark.parametrize("name", ["host_table_repeated_ids", "host_fp8_rows", "host_e8m0_scales"])
def test_gather_rows_is_exact(name):
    (table, ids), _ = _case_inputs("gather_rows", name, torch.bfloat16)
    got = gather_rows(table, ids)
    assert got.dtype == table.dtype
    assert torch.equal(got.view(torch.uint8), KernelOps().gather_rows(table, ids).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,scale_format", [(16, "e4m3"), (32, "ue8m0")])
def test_fp4_decode_equals_reference_bitwise(dtype, block, scale_format):
    """Quantised vectors over many binades in the leading dims of a paged read ([S, n, d/2]), then every
    code byte under every scale byte (negative, subnormal, NaN and infinite scales too); exact, as the
    reference (NaN where it is NaN)."""
    gen = torch.Generator().manual_seed(block)
    x = torch.randn(3, 7, 128, generator=gen) * torch.exp2(torch.randint(-14, 8, (3, 7, 1), generator=gen).float())
    packed, scales = KernelOps().fp4_block_quantize(x, block, scale_format)
    assert torch.equal(fp4_block_dequantize(packed, scales, dtype), KernelOps().fp4_block_dequantize(packed, scales, dtype))
    every = torch.arange(256, dtype=torch.uint8)
    packed = every.repeat(256, 1)  # row r: every code byte, 512 values...
    scales = every.view(-1, 1).repeat(1, 512 // block).view(scales.dtype)  # ...under scale byte r
    ours, reference = fp4_block_dequantize(packed, scales, dtype), KernelOps().fp4_block_dequantize(packed, scales, dtype)
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours.nan_to_num(), reference.nan_to_num())
