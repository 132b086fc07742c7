"""EPLB: a placement from observed per-expert load balances tokens per rank, and applying it between
steps (expert weights moved through the communicator) leaves the layer's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from parallel_fixtures import SCORE_LAYER, held_in_one_stack, random_moe, random_tokens, relative_error, tiny_config

from deepinfer_core.distributed import (
    ExpertLoad,
    ExpertParallelMoE,
    ExpertPlacement,
    PlacementError,
    rank_imbalance,
    rebalance_experts,
    spawn,
)
from deepinfer_core.reference.backend import CpuBackend

# As in test_parallel_ep_moe: same arithmetic and order as the single-process layer, CPU GEMM rounding only.
TOLERANCE = 1e-5
# A selection bias that sends most tokens to the first experts, as a skewed real load would.
SKEW = torch.tensor([1.2, 0.8, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0])
TOKENS_PER_RANK = 48


def _zipf(num_layers: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(num_layers)]) + 1
    return (1000.0 / ranks.double() ** 1.2).round()


@pytest.mark.parametrize("experts, ep, redundant", [(8, 4, 4), (16, 4, 4), (64, 8, 16), (256, 16, 32)])
def test_balanced_placement_evens_out_a_skewed_load(experts: int, ep: int, redundant: int) -> None:
    loads = _zipf(3, experts, seed=experts + ep)
    placement = ExpertPlacement.balanced(loads, ep, redundant)
    assert placement.slots_per_rank == (experts + redundant) // ep
    for layer in range(3):
        for rank in range(ep):
            held = placement.rank_experts(layer, rank)
            assert len(set(held)) == len(held)
    before = rank_imbalance(ExpertPlacement.contiguous(3, experts, ep).rank_loads(loads))
    after = rank_imbalance(placement.rank_loads(loads))
    print(f"E={experts} ep={ep} redundant={redundant}: max/mean tokens per rank {before:.3f} -> {after:.3f}")
    assert before > 1.3
    assert after < 1.1
    assert torch.equal(ExpertPlacement.balanced(loads, ep, redundant).slot_experts, placement.slot_experts)


def test_malformed_placements_are_rejected() -> None:
    with pytest.raises(PlacementError, match=r"experts \[3\] have no slot"):
        ExpertPlacement(4, 2, torch.tensor([[0, 1, 2, 2]]))
    with pytest.raises(PlacementError, match="holds an expert twice"):
        ExpertPlacement(4, 2, torch.tensor([[0, 0, 1, 2, 3, 1]]))
    with pytest.raises(PlacementError, match="cannot be split over ep=3"):
        ExpertPlacement.contiguous(1, 8, 3)


def _skewed_layer_rebalanced(rank: int, world: int, redundant: int) -> dict:
    config = tiny_config()
    moe = random_moe(config, SCORE_LAYER, seed=21, skew=SKEW)
    x, ids = random_tokens(config, TOKENS_PER_RANK * world, seed=22)
    want = moe(x, ids)
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    comm = CpuBackend().communicator()
    load = ExpertLoad.zeros(1, config.n_routed_experts, world)
    layer = ExpertParallelMoE(
        moe, 0, ExpertPlacement.contiguous(1, config.n_routed_experts, world), comm, load=load
    )
    first = layer(x[mine], ids[mine])
    one_stack_before = held_in_one_stack(layer)
    observed = load.summed(comm)
    placement = ExpertPlacement.balanced(observed.expert_tokens, world, redundant)
    rebalance_experts([layer], placement)
    load.reset()
    second = layer(x[mine], ids[mine])
    return {
        "before": rank_imbalance(observed.rank_tokens),
        "after": rank_imbalance(load.summed(comm).rank_tokens),
        "error": max(relative_error(first, want[mine]), relative_error(second, want[mine])),
        "unchanged": relative_error(second, first),
        "held": sorted(int(e) for e in layer.experts),
        "placed": sorted(placement.rank_experts(0, rank)),
        "one_stack": (one_stack_before, held_in_one_stack(layer)),
    }


@pytest.mark.parametrize("world, redundant", [(2, 2), (4, 4)])
def test_rebalancing_a_skewed_layer_moves_weights_and_keeps_outputs(world: int, redundant: int) -> None:
    results = spawn(_skewed_layer_rebalanced, world, CpuBackend(), args=(redundant,), timeout_s=50)
    before, after = results[0]["before"], results[0]["after"]
    print(f"ep={world} redundant={redundant}: max/mean tokens per rank {before:.3f} -> {after:.3f}")
    assert all(r["held"] == r["placed"] for r in results)
    assert all(r["one_stack"] == (True, True) for r in results)  # held experts alone in one stack, before and after
    assert before > 1.5, "the synthetic load is not skewed enough to test balancing"
    assert after < 1.15
    assert max(r["error"] for r in results) <= TOLERANCE, results
    assert max(r["unchanged"] for r in results) <= TOLERANCE, results
