"""The expert-parallel MoE layer on 2 and 4 gloo processes equals the single-process layer.

Every rank builds the same random layer, computes the single-process output of all tokens itself,
then runs only its own rows through the EP layer (experts spread over the ranks, tokens exchanged by
all-to-all) and compares. Uneven token shares include a rank with no tokens at all. Covers V4's
hash- and score-routed layers (float32 and bfloat16), redundant expert copies, replicated tokens
(attention not data-parallel), and V4.1's MoE.
"""

from __future__ import annotations

import pytest
import torch
from parallel_fixtures import HASH_LAYER, SCORE_LAYER, random_moe, random_tokens, relative_error, tiny_config
from v41_fixtures import model as v41_model

from deepinfer_core.distributed import ExpertParallelMoE, ExpertPlacement, spawn
from deepinfer_core.reference.backend import CpuBackend

# Each pair's expert output and each token's sum follow fused_moe's order exactly, so the EP result
# differs only where a GEMM's rounding depends on its row count (CPU GEMMs are not batch-invariant):
# float32 rounding of a few ulps of a D=64 dot product, far below 1e-5 relative.
TOLERANCE = 1e-5


def _ep_layer_error(
    rank: int, world: int, layer: int, shares: list[int], redundant: int, replicated: bool, dtype: torch.dtype
) -> float:
    config = tiny_config()
    moe = random_moe(config, layer, seed=11, dtype=dtype)
    x, ids = random_tokens(config, sum(shares), seed=12)
    x = x.to(dtype)
    want = moe(x, ids)
    experts = config.n_routed_experts
    if redundant:
        load = torch.rand(1, experts, generator=torch.Generator().manual_seed(13))
        placement = ExpertPlacement.balanced(load, world, redundant)
    else:
        placement = ExpertPlacement.contiguous(1, experts, world)
    ep = ExpertParallelMoE(moe, 0, placement, CpuBackend().communicator(), tokens_replicated=replicated)
    assert sorted(int(e) for e in ep.experts) == sorted(placement.rank_experts(0, rank))
    if replicated:
        return relative_error(ep(x, ids), want)
    start = sum(shares[:rank])
    mine = slice(start, start + shares[rank])
    return relative_error(ep(x[mine], ids[mine]), want[mine])


F32, BF16 = torch.float32, torch.bfloat16
# (ranks, layer, tokens per rank (one entry: every rank has all of them), redundant experts, dtype)
CASES = {
    "2_ranks_score": (2, SCORE_LAYER, [9, 14], 0, F32),
    "2_ranks_hash_rank1_idle": (2, HASH_LAYER, [17, 0], 0, F32),
    "2_ranks_score_bfloat16": (2, SCORE_LAYER, [12, 7], 0, BF16),
    "4_ranks_score_rank0_idle": (4, SCORE_LAYER, [0, 5, 11, 3], 0, F32),
    "4_ranks_redundant_experts": (4, SCORE_LAYER, [6, 0, 13, 4], 4, F32),
    "4_ranks_replicated_tokens": (4, HASH_LAYER, [13], 0, F32),
}
# bfloat16: the same order of bfloat16 roundings as the single-process layer, except where a GEMM's
# rounding depends on its row count; one bfloat16 ulp (2**-8) of a few outputs, well under 1e-2 relative.
TOLERANCES = {F32: TOLERANCE, BF16: 1e-2}


@pytest.mark.parametrize("name", CASES)
def test_ep_layer_matches_single_process(name: str) -> None:
    world, layer, shares, redundant, dtype = CASES[name]
    replicated = len(shares) == 1
    errors = spawn(
        _ep_layer_error, world, CpuBackend(), args=(layer, shares, redundant, replicated, dtype), timeout_s=50
    )
    assert max(errors) <= TOLERANCES[dtype], errors


def _v41_layer_error(rank: int, world: int, shares: list[int], redundant: int) -> float:
    moe = v41_model("a_release_like", "bf16").layers[3].ffn
    experts, hidden = moe.config.n_routed_experts, moe.config.hidden_size
    x = torch.randn(sum(shares), hidden, generator=torch.Generator().manual_seed(31))
    want = moe(x)
    if redundant:
        load = torch.rand(1, experts, generator=torch.Generator().manual_seed(32))
        placement = ExpertPlacement.balanced(load, world, redundant)
    else:
        placement = ExpertPlacement.contiguous(1, experts, world)
    ep = ExpertParallelMoE(moe, 0, placement, CpuBackend().communicator())
    start = sum(shares[:rank])
    mine = slice(start, start + shares[rank])
    return relative_error(ep(x[mine]), want[mine])


@pytest.mark.parametrize("world, shares, redundant", [(2, [7, 12], 0), (4, [5, 0, 9, 3], 2)])
def test_ep_layer_matches_single_process_v41(world: int, shares: list[int], redundant: int) -> None:
    errors = spawn(_v41_layer_error, world, CpuBackend(), args=(shares, redundant), timeout_s=50)
    assert max(errors) <= TOLERANCE, errors
