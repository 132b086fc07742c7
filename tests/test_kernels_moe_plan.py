"""The grouped-GEMM plan's Triton kernels (`moe_plan`) against the torch plan they replaced, through
the interpreter: the outputs must be identical, for any ids, held subset and block size."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch
import triton

from deepinfer_kernels import moe_plan as plan_module
from deepinfer_kernels.moe_plan import moe_plan


def _reference_plan(ids: torch.Tensor, local_ids: torch.Tensor, num_held: int, block_m: int):
    """The torch plan (~20 launches) the kernels replaced: stable sort by held expert, runs padded."""
    pairs = ids.numel()
    local = local_ids[ids.reshape(-1)]
    counts = torch.zeros(num_held + 1, dtype=torch.long, device=ids.device)
    counts = counts.scatter_add_(0, local, torch.ones_like(local))[:num_held]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    ends = torch.cumsum(counts, 0)
    order = torch.argsort(local, stable=True)
    sorted_local = local[order]
    held = sorted_local < num_held
    expert = sorted_local.clamp(max=num_held - 1)
    dest = pad_ends[expert] - padded[expert] + torch.arange(pairs, device=ids.device) - (ends[expert] - counts[expert])
    rows = pairs + min(num_held, pairs) * (block_m - 1)
    rows = triton.cdiv(rows, block_m) * block_m
    row_entry = torch.full((rows + 1,), -1, dtype=torch.int32, device=ids.device)
    row_entry[torch.where(held, dest, rows)] = order.to(torch.int32)
    starts = torch.arange(0, rows, block_m, device=ids.device)
    expert = torch.searchsorted(pad_ends, starts, right=True).clamp(max=num_held)
    owned = expert < num_held
    run = expert.clamp(max=num_held - 1)
    first = torch.where(owned, (pad_ends[run] - padded[run]) // block_m, starts // block_m)
    length = torch.where(owned, padded[run] // block_m, 1)
    return row_entry[:rows], torch.stack([expert, first, length], 1).to(torch.int32)


def _random_routing(tokens: int, top_k: int, experts: int, num_held: int, seed: int):
    """ids [T, k] (distinct per token, as routing gives) and a random held subset in a random stack order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    local_ids = torch.full((experts,), num_held, dtype=torch.long)
    local_ids[torch.randperm(experts, generator=gen)[:num_held]] = torch.randperm(num_held, generator=gen)
    return ids, local_ids


def _assert_same_plan(ids, local_ids, num_held, block_m, shared=False):
    """With `shared`, pair t * (k + 1) + k is the shared expert's (stack index num_held): the same plan as
    routing each token to k + 1 experts, the last one an extra held expert, and not-held pairs still dropped."""
    row_entry, blocks = moe_plan(ids, local_ids, num_held, block_m, shared=shared)
    if shared:
        experts = local_ids.shape[0]
        ids = torch.cat([ids, torch.full((ids.shape[0], 1), experts)], dim=1)
        local_ids = torch.cat([local_ids.masked_fill(local_ids == num_held, num_held + 1), torch.tensor([num_held])])
        num_held += 1
    expected_rows, expected_blocks = _reference_plan(ids, local_ids, num_held, block_m)
    assert row_entry.dtype == blocks.dtype == torch.int32
    assert torch.equal(row_entry, expected_rows)
    assert torch.equal(blocks, expected_blocks)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "num_held"),
    [(1, 1, 4, 4), (1, 8, 64, 64), (3, 2, 4, 3), (7, 6, 64, 16), (23, 4, 16, 5), (130, 8, 64, 64),
     (257, 3, 32, 1), (300, 6, 48, 37)],
)
def test_plan_matches_torch_plan(tokens, top_k, experts, num_held, block_m):
    ids, local_ids = _random_routing(tokens, top_k, experts, num_held, seed=tokens * 100 + top_k)
    _assert_same_plan(ids, local_ids, num_held, block_m)


def test_plan_matches_with_repeated_ids_and_no_held_pair():
    """Duplicate ids in a token (the plan does not assume distinct ones) and a batch whose pairs all
    belong to experts another rank holds (every row padding, every block past the end)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 12, (40, 5), generator=gen)
    local_ids = torch.randperm(12, generator=gen)
    _assert_same_plan(ids, local_ids, 12, 16)
    local_ids = torch.tensor([0, 1] + [2] * 10)
    _assert_same_plan(torch.randint(2, 12, (9, 4), generator=gen), local_ids, 2, 16)


def test_plan_matches_at_prefill_size():
    """Enough pairs for many chunks per expert (the tally across chunks) with 256 experts and tall blocks."""
    ids, local_ids = _random_routing(256, 8, 256, 256, seed=3)
    _assert_same_plan(ids, local_ids, 256, 128)


@pytest.mark.parametrize(("tokens", "top_k", "experts", "num_held"), [(1, 2, 8, 8), (23, 4, 16, 5), (130, 6, 64, 64)])
def test_plan_with_the_shared_expert_as_one_more_pair_per_token(tokens, top_k, experts, num_held):
    """`shared`: see `_assert_same_plan`."""
    ids, local_ids = _random_routing(tokens, top_k, experts, num_held, seed=tokens)
    _assert_same_plan(ids, local_ids, num_held, 16, shared=True)


def test_plan_matches_with_prefill_sized_chunks():
    """Past _LARGE_FROM pairs the plan takes larger chunks."""
    ids, local_ids = _random_routing(700, 6, 64, 40, seed=8)
    assert ids.numel() > plan_module._LARGE_FROM
    _assert_same_plan(ids, local_ids, 40, 128)


@pytest.mark.parametrize("block_m", [8, 16, 64])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 6), (1, 7), (1, 8), (2, 3)])
def test_one_launch_plan_equals_the_reference_plan(tokens, top_k, block_m):
    """A plan of up to 8 pairs and 128 padded rows takes one launch (a decode step's token at top-6 with the
    shared expert), past either three: the same plan either way, with the shared expert, experts not held and
    an expert picked twice by a token."""
    ids, local_ids = _random_routing(tokens, top_k, 32, 20, seed=tokens + top_k + block_m)
    ids[0, -1] = ids[0, 0]
    for shared in (False, True):
        _assert_same_plan(ids, local_ids, 20, block_m, shared)


def test_a_decode_token_takes_the_one_launch_plan():
    """The case the one-launch plan is for: one token at top-6 with the shared expert in 8- or 16-row blocks."""
    for block_m in (8, 16):
        assert plan_module.one_launch_plan(7, plan_module.plan_rows(7, 257, block_m))
    assert not plan_module.one_launch_plan(7, 7 * 64)  # 64-row blocks (batch-invariant tiles)
