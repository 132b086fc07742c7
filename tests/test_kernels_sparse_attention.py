"""Triton `sparse_attention` (prefill and decode over the paged cache) against the reference op."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import fake_quantize_fp8_activations, quantize_fp8_activations
from deepinfer_kernels.sparse_attention import sparse_attention

# float32: summation order (~1e-7). bfloat16: the probabilities are cast to bf16 before the value sum
# on both sides, but the kernel's are unnormalised (online softmax) and rounded in a different place:
# a few bf16 roundings apart (~1e-2 in norm at these sizes).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}

RING, BLOCK_SIZE, RATIO, NUM_SLOTS, NUM_BLOCKS = 8, 16, 4, 5, 40


def _batch(query_lens: list[int], context_lens: list[int], gen: torch.Generator) -> ForwardBatch:
    """Random distinct slots and shuffled block tables; enough blocks for every position used."""
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(query_lens)].tolist()
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    per_seq = NUM_BLOCKS // len(query_lens)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(len(query_lens))]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.zeros(int(starts[-1]), dtype=torch.long),
        positions=torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)]),
        query_start_loc=starts,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=starts[1:].long() - 1,
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        slot_ids_cpu=slots,
        block_tables_cpu=tables,
    )


def _picks(n_entries: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct values of -1 .. n_entries-1 (padded with -1 when there are fewer)."""
    picks = torch.full((k,), -1, dtype=torch.long)
    drawn = torch.randperm(n_entries + 1, generator=gen)[:k] - 1
    picks[: drawn.numel()] = drawn
    return picks


def _layer_kwargs(layer: str, batch: ForwardBatch, dim: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """The compressed entries of an "all_entries" or "selected" layer and, for "selected", distinct picks
    per row among the sequence's entries (some not yet visible to the row) and -1; the contract has no
    meaning for indices past the sequence's entries."""
    if layer == "sliding":
        return {}
    kwargs = {"entries": torch.randn(NUM_BLOCKS, BLOCK_SIZE // RATIO, dim, generator=gen).to(dtype), "ratio": RATIO}
    if layer == "selected":
        kwargs["selected"] = torch.cat([
            torch.stack([_picks((ctx + n) // RATIO, 3, gen) for _ in range(n)])
            for n, ctx in zip(batch.query_lens_cpu, batch.context_lens_cpu)
        ])
    return kwargs


STEPS = {
    # fresh prefill longer than the ring, a continued chunk, decodes before and after the ring wraps
    "mixed": ([11, 5, 1, 1], [0, 13, 3, 37]),
    "decode": ([1, 1, 1], [60, 9, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["sliding", "all_entries", "selected"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_sparse_attention_matches_reference(dtype, layer, step):
    heads, dim = 20, 48  # more heads than one head block, a head_dim that is not a power of two
    gen = torch.Generator().manual_seed(len(layer) * 10 + len(step))
    batch = _batch(*STEPS[step], gen)
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(tokens, dim, generator=gen).to(dtype)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    kwargs = _layer_kwargs(layer, batch, dim, dtype, gen)
    args = (q, kv, window, sinks, dim**-0.5, batch)
    out = sparse_attention(*args, **kwargs)
    assert_matches(out, KernelOps().sparse_attention(*args, **kwargs), TOLERANCE[dtype])


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_sparse_attention_honours_window_starts(batch_invariant):
    """Bounded prefix replay: no window KV below each sequence's start, even where the ring has rows."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(21)
    batch = _batch([5, 1, 3], [9, 12, 6], gen)
    batch = replace(batch, window_starts_cpu=[7, 12, 0])  # mid-window, at the step's first row, none
    heads, dim = 4, 32
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen)
    kv = torch.randn(batch.num_tokens, dim, generator=gen)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    args = (q, kv, window, sinks, dim**-0.5, batch)
    out = sparse_attention(*args, batch_invariant=batch_invariant)
    expected = KernelOps().sparse_attention(*args)
    assert_matches(out, expected, TOLERANCE[torch.float32])
    assert not torch.allclose(expected, KernelOps().sparse_attention(*args[:5], replace(batch, window_starts_cpu=None)))


def test_prefill_sized_step_takes_wide_head_blocks_and_matches_reference():
    """>= 512 bf16 queries: one program per token and 64 heads (70 heads: a partial second block)."""
    from deepinfer_kernels.sparse_attention import tile_config

    assert tile_config(520, 32, torch.bfloat16, False)[0] == 64
    gen = torch.Generator().manual_seed(5)
    batch = _batch([520], [0], gen)
    heads, dim = 70, 32
    q = torch.randn(520, heads, dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(520, dim, generator=gen).to(torch.bfloat16)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen)
    entries = torch.randn(NUM_BLOCKS, BLOCK_SIZE // RATIO, dim, generator=gen).to(torch.bfloat16)
    selected = torch.stack([_picks(130, 6, gen) for _ in range(520)])
    args = (q, kv, window, sinks, dim**-0.5, batch)
    out = sparse_attention(*args, entries=entries, ratio=RATIO, selected=selected)
    expected = KernelOps().sparse_attention(*args, entries=entries, ratio=RATIO, selected=selected)
    assert_matches(out, expected, TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("layer", ["sliding", "all_entries", "selected"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_split_keys_match_reference(layer, step):
    """A step with fewer programs than multiprocessors splits its keys (decode: 6 programs, 8 splits,
    some with no key block; mixed: 2 splits) and combines the splits to the reference's result."""
    from deepinfer_kernels.sparse_attention import key_splits

    heads, dim = 20, 48
    gen = torch.Generator().manual_seed(len(layer) + 7 * len(step))
    batch = _batch(*STEPS[step], gen)
    tokens = batch.num_tokens
    assert key_splits(tokens * 2, 48, False) == (8 if step == "decode" else 2)
    assert key_splits(tokens * 2, 48, True) == 1
    q = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen)
    kwargs = _layer_kwargs(layer, batch, dim, torch.bfloat16, gen)
    args = (q, kv, window, sinks, dim**-0.5, batch)
    out = sparse_attention(*args, **kwargs, num_sms=48)
    assert_matches(out, KernelOps().sparse_attention(*args, **kwargs), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("q_norm", [False, True])
@pytest.mark.parametrize("layer", ["sliding", "all_entries", "selected"])
@pytest.mark.parametrize("step,num_sms", [("mixed", None), ("decode", None), ("decode", 48)])
def test_rotary_attention_matches_reference(layer, step, num_sms, q_norm):
    """The query's norm and rope in the kernel's load and the output's inverse rope in its store (or, with
    split keys, in the combining launch) against the reference's norm, rope, attention and rope."""
    heads, dim = 20, 48
    gen = torch.Generator().manual_seed(11 * len(layer) + len(step) + q_norm)
    batch = _batch(*STEPS[step], gen)
    tokens = batch.num_tokens
    q = (3 * torch.randn(tokens, heads, dim, generator=gen)).to(torch.bfloat16)
    kv = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # the last 16 channels
    kwargs = _layer_kwargs(layer, batch, dim, torch.bfloat16, gen)
    eps = 1e-6 if q_norm else None
    args = (q, kv, window, sinks, dim**-0.5, batch)
    expected = KernelOps().rotary_attention(*args, inv_freq, eps, **kwargs)
    out = sparse_attention(q.clone(), *args[1:], **kwargs, num_sms=num_sms, inv_freq=inv_freq, q_norm_eps=eps)
    assert_matches(out, expected, TOLERANCE[torch.bfloat16])
    plain = KernelOps().sparse_attention(*args, **kwargs)
    assert (plain - expected).norm() > 0.1 * expected.norm()  # the rotations and the norm matter here


def test_rotary_attention_refuses_an_odd_head_dim():
    gen = torch.Generator().manual_seed(0)
    batch = _batch([2], [0], gen)
    q = torch.randn(2, 2, 7, generator=gen)
    with pytest.raises(ValueError, match="even head dim"):
        sparse_attention(q, q[:, 0], torch.zeros(NUM_SLOTS, RING, 7), torch.zeros(2), 1.0, batch,
                         inv_freq=torch.ones(2))


@pytest.mark.parametrize("step,num_sms", [("mixed", None), ("decode", 48)])
def test_rotary_attention_quantized_is_the_output_quantised(step, num_sms):
    """`quantize_group`: the launches' own bf16 output quantised over each token's row of H * d values (groups
    straddle heads here: d 48, groups of 32), bit for bit; and the reference op's codes round the reference output."""
    heads, dim, group = 20, 48, 32
    gen = torch.Generator().manual_seed(5 + len(step))
    batch = _batch(*STEPS[step], gen)
    q = (3 * torch.randn(batch.num_tokens, heads, dim, generator=gen)).to(torch.bfloat16)
    kv = torch.randn(batch.num_tokens, dim, generator=gen).to(torch.bfloat16)
    window = torch.randn(NUM_SLOTS, RING, dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    kwargs = _layer_kwargs("selected", batch, dim, torch.bfloat16, gen)
    args = (kv, window, sinks, dim**-0.5, batch)
    out = sparse_attention(q.clone(), *args, **kwargs, num_sms=num_sms, inv_freq=inv_freq, q_norm_eps=1e-6)
    codes, scales = sparse_attention(q.clone(), *args, **kwargs, num_sms=num_sms, inv_freq=inv_freq, q_norm_eps=1e-6,
                                     quantize_group=group)
    expected_codes, expected_scales = quantize_fp8_activations(out.view(out.shape[0], -1), group)
    assert codes.shape == out.shape and scales.shape == (out.shape[0], heads * dim // group)
    assert torch.equal(codes.view(torch.uint8).flatten(1), expected_codes.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    reference = KernelOps().rotary_attention_quantized(q, *args, inv_freq, group, 1e-6, **kwargs)
    rounded = fake_quantize_fp8_activations(KernelOps().rotary_attention(q, *args, inv_freq, 1e-6, **kwargs)
                                            .flatten(1), group)
    assert torch.equal(reference.dequantize(), rounded)


def test_rotary_attention_quantized_refuses_a_row_of_partial_groups():
    gen = torch.Generator().manual_seed(0)
    batch = _batch([2], [0], gen)
    q = torch.randn(2, 3, 8, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="splits 16-column groups"):
        sparse_attention(q, q[:, 0], torch.zeros(NUM_SLOTS, RING, 8, dtype=torch.bfloat16), torch.zeros(3), 1.0, batch,
                         inv_freq=torch.ones(2), quantize_group=16)
