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
from deepinfer_kernels import top_entries as top_entries_module
from deepinfer_kernels.cache_writes import store_window
from deepinfer_kernels.kv_codes import fp4_block_dequantize, fp4_block_quantize, fp8_block_dequantize, fp8_block_quantize
from deepinfer_kernels.indexer import indexer_topk
from deepinfer_kernels.indexer_scores import indexer_scores
from deepinfer_kernels.rope import rope
from deepinfer_kernels.row_gather import gather_row_copies, gather_rows

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


# rows a token across the kernel's program tiles: one row, several tokens a program with a partial last
# program, a token's rows over several programs with a partial last block (the kernel takes 64 rows a program)
@pytest.mark.parametrize("shape", [(37, 24), (5, 3, 16), (3, 100, 16)])
@pytest.mark.parametrize("inplace", [False, True])
def test_rope_tiles_cover_every_row(shape, inplace):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 70000, (shape[0],), generator=gen)
    inv_freq = torch.rand(4, generator=gen)
    expected = KernelOps().rope(x, positions, inv_freq)
    assert_matches(rope(x.clone(), positions, inv_freq, inplace=inplace), expected, ROPE_TOL[torch.bfloat16])


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


@pytest.mark.parametrize("ranked", [True, False])
def test_top_entries_match_the_stable_sort(monkeypatch, ranked):
    """`KernelOps.top_entries` on the NVIDIA backend, ranks in one launch or (past the comparison bound) the
    selection, against the reference's: equal ids, ties to the lowest entry, -1 for -inf, narrower k than the row."""
    (scores, k), _ = _case_inputs("top_entries", "ties_and_unseen", torch.float32)
    if not ranked:
        monkeypatch.setattr(top_entries_module, "_RANK_COMPARISONS", 0)
    got = top_entries_module.top_entries(scores, k)
    assert torch.equal(got, KernelOps().top_entries(scores, k))
    assert (got[3] == -1).all() and (got[0] >= 0).any()


def _hard_scores(rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Scores that a key order could get wrong: few distinct values (ties across the k-th), +-0.0, negatives,
    subnormals, +-inf, NaN, whole rows unseen."""
    values = torch.tensor([0.0, -0.0, 1.5, -1.5, 3e-39, -3e-39, 7.0, -2.0, float("inf"), float("-inf"),
                           float("nan"), 1e30, -1e30])
    scores = values[torch.randint(0, len(values), (rows, width), generator=gen)]
    scores[0] = torch.randn(width, generator=gen)  # distinct values
    scores[1] = float("-inf")
    scores[2, : width // 2] = float("-inf")
    scores[3] = torch.randint(0, 3, (width,), generator=gen).float()  # long runs of ties
    return scores


@pytest.mark.parametrize("width,k,block", [(70, 13, 16), (70, 64, 16), (40, 64, 16), (100, 32, 128), (33, 33, 8)])
def test_top_entries_selection_is_the_stable_sort(monkeypatch, width, k, block):
    """The selection (a program a row, past the rank kernel's bound) equals the reference's stable sort exactly:
    rows streamed in blocks past the resident one, k not a power of two, rows narrower than k, ties at the k-th
    score, -0.0 against +0.0, subnormals, NaN (first in torch's order, -1 as not above -inf) and unseen rows."""
    monkeypatch.setattr(top_entries_module, "_RANK_COMPARISONS", 0)
    monkeypatch.setattr(top_entries_module, "_SELECT_MAX_BLOCK", block)
    scores = _hard_scores(9, width, torch.Generator().manual_seed(width * k))
    got = top_entries_module.top_entries(scores, k)
    reference = KernelOps().top_entries(scores, min(k, width))
    assert torch.equal(got[:, : min(k, width)], reference)
    assert (got[:, width:] == -1).all() and (got[1] == -1).all()


@pytest.mark.parametrize("width", [24, 13, 2100])  # 32-bit words, bytes (13 bf16 = 26), two column programs
def test_gather_row_copies_fill_every_stream(width):
    """`hc_embedding` on the NVIDIA backend: each row in every copy, exact; 17 rows span several programs."""
    gen = torch.Generator().manual_seed(width)
    table = torch.randn(50, width, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 50, (17,), generator=gen)
    got = gather_row_copies(table, ids, 4)
    assert torch.equal(got.view(torch.uint8), KernelOps().hc_embedding(ids, table, 4).view(torch.uint8))


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


def _binades(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values over many binades a block, and many exact e4m3 ties: multiples of 1/16 (the 3-bit mantissa's
    half steps) times a power of two per row."""
    steps = torch.randint(-256, 257, shape, generator=gen).float() / 16
    return steps * torch.exp2(torch.randint(-20, 8, (*shape[:-1], 1), generator=gen).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_equal_reference_bitwise(dtype):
    """Window-KV codes: quantised over many binades (blocks below the 1e-4 floor, zeros, ties, -0.0) in the
    leading dims of a step ([S, n, d]), then every e4m3 byte under every exponent byte decoded."""
    gen = torch.Generator().manual_seed(8)
    x = torch.cat([_binades(gen, 3, 5, 256), torch.randn(3, 1, 256, generator=gen) * 1e-6], dim=1)
    x[0, 0, :32] = -0.0
    x = x.to(dtype)
    codes, exponents = fp8_block_quantize(x, 32)
    ref_codes, ref_exponents = KernelOps().fp8_block_quantize(x, 32)
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(exponents, ref_exponents)
    every = torch.arange(256, dtype=torch.uint8)
    values = every.repeat(256, 1).view(torch.float8_e4m3fn)  # row r: every code byte...
    exponents = every.view(-1, 1).repeat(1, 256 // 32)  # ...under exponent byte r
    ours, reference = fp8_block_dequantize(values, exponents, dtype), KernelOps().fp8_block_dequantize(values, exponents, dtype)
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours.nan_to_num(), reference.nan_to_num())


def _threshold_blocks(scale: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks of amax 6 * scale (so the block's scale is `scale` in both formats) whose other values sit on
    the e2m1 thresholds and half-way values, both signs: the ties of the rounding."""
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0, 0.0, -0.0, 0.1, 5.5])
    q = torch.cat([points, -points])[torch.arange(block - 1) % (2 * points.numel())]
    return torch.cat([torch.full((scale.numel(), 1), 6.0), q.expand(scale.numel(), -1)], dim=1) * scale[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,scale_format", [(16, "e4m3"), (32, "ue8m0")])
def test_fp4_quantize_equals_reference_bitwise(dtype, block, scale_format):
    """Index-key and entry codes: vectors over many binades, blocks on the rounding's ties under many scales,
    tiny blocks (the scale's floor) and, in e4m3, blocks past its range (the scale saturates at 448)."""
    gen = torch.Generator().manual_seed(4 + block)
    if scale_format == "e4m3":  # every positive finite e4m3 scale
        scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        scales = torch.exp2(torch.arange(-40, 40).float())
    ties = _threshold_blocks(scales, block)
    ties = ties[: ties.shape[0] - ties.shape[0] % (128 // block)].reshape(-1, 128)
    x = torch.cat([
        _binades(gen, 40, 128), torch.randn(4, 128, generator=gen) * 1e-30, torch.randn(4, 128, generator=gen) * 1e4,
        ties,
    ]).to(dtype)
    packed, scale_bytes = fp4_block_quantize(x, block, scale_format)
    ref_packed, ref_scales = KernelOps().fp4_block_quantize(x, block, scale_format)
    assert torch.equal(packed, ref_packed)
    assert scale_bytes.dtype == ref_scales.dtype and torch.equal(scale_bytes.view(torch.uint8), ref_scales.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e4m3", "fp4_ue8m0"])
def test_paged_decode_gathers_rows_as_the_reference(fmt):
    """Decoding `rows` of a paged pool [blocks, per_block, d] (repeats included) equals the reference's
    gather-then-decode bit for bit; rows in any shape give that shape."""
    gen = torch.Generator().manual_seed(3)
    x = _binades(gen, 6, 4, 256)
    if fmt == "fp8":
        parts, decode = KernelOps().fp8_block_quantize(x, 32), fp8_block_dequantize
    else:
        block, scale_format = (16, "e4m3") if fmt == "fp4_e4m3" else (32, "ue8m0")
        parts, decode = KernelOps().fp4_block_quantize(x, block, scale_format), fp4_block_dequantize
    rows = torch.randint(0, 24, (3, 5, 2), generator=gen)
    reference = getattr(KernelOps(), decode.__name__)(*parts, torch.bfloat16, rows=rows)
    assert reference.shape == (3, 5, 2, 256)
    assert torch.equal(decode(*parts, torch.bfloat16, rows=rows), reference)


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e4m3", "fp4_ue8m0"])
def test_paged_encode_writes_rows_as_the_reference(fmt):
    """Encoding into `rows` of a paged pool [blocks, per_block, ...] (a cache write) writes what the reference
    writes there, bit for bit, and leaves every other vector as it was."""
    gen = torch.Generator().manual_seed(5)
    args = (32,) if fmt == "fp8" else ((16, "e4m3") if fmt == "fp4_e4m3" else (32, "ue8m0"))
    encode = fp8_block_quantize if fmt == "fp8" else fp4_block_quantize
    pool = getattr(KernelOps(), encode.__name__)(_binades(gen, 6, 4, 256), *args)
    x, rows = _binades(gen, 9, 256).to(torch.bfloat16), torch.randperm(24, generator=gen)[:9]
    ours = encode(x, *args, out=tuple(part.clone() for part in pool), rows=rows)
    reference = getattr(KernelOps(), encode.__name__)(x, *args, out=tuple(part.clone() for part in pool), rows=rows)
    for got, expected, before in zip(ours, reference, pool):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        kept = torch.ones(24, dtype=torch.bool)
        kept[rows] = False
        assert torch.equal(got.view(torch.uint8).flatten(0, 1)[kept], before.view(torch.uint8).flatten(0, 1)[kept])
    with pytest.raises(ValueError, match="both or neither"):
        encode(x, *args, rows=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("n_heads", [4, 24])
def test_indexer_scores_match_reference(dtype, per_row, n_heads):
    """V4.1's scores: keys per query row (a decode step) or shared (one sequence's prefill), entries past one
    tile and heads short of the MMA's 16 or not a power of two; fp4-quantised values, as the model's."""
    gen = torch.Generator().manual_seed(n_heads + per_row)
    ops = KernelOps()

    def fp4(*shape):  # the model's queries and keys: values of the index format
        return ops.fp4_block_dequantize(*ops.fp4_block_quantize(torch.randn(*shape, generator=gen), 32, "ue8m0"), dtype)

    q = fp4(5, n_heads, 32)
    keys = fp4(5, 70, 32) if per_row else fp4(70, 32)
    head_weights = torch.randn(5, n_heads, generator=gen).to(dtype)
    ours = indexer_scores(q, keys, head_weights)
    assert ours.dtype == torch.float32 and ours.shape == (5, 70)
    assert_matches(ours, ops.indexer_scores(q, keys, head_weights), 1e-5)
