"""Multi-process runs fail loudly and on time: bad rank counts, a rank that dies, a rank that hangs."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from parallel_fixtures import SCORE_LAYER, random_moe, random_tokens, tiny_config

from deepinfer_core.distributed import (
    ExpertParallelMoE,
    ExpertPlacement,
    LaunchTimeout,
    ParallelConfigError,
    ParallelGroups,
    ParallelLayout,
    RankFailed,
    init_from_env,
    spawn,
)
from deepinfer_core.reference.backend import CpuBackend


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=3, rank=0, ep=2, dp=3, num_experts=8), r"`ep` must divide world_size=3"),
    (dict(world_size=4, rank=0, ep=4, dp=2, num_experts=8), r"`dp` must be 1 .* or world_size=4"),
    (dict(world_size=3, rank=0, ep=3, dp=3, num_experts=8), r"8 \+ num_redundant_experts=0 = 8 expert slots cannot"),
    (dict(world_size=2, rank=2, ep=2, dp=2, num_experts=8), r"`rank` must be in \[0, 2\)"),
    (dict(world_size=2, rank=0, ep=2, dp=2, num_experts=8, num_redundant_experts=10), r"num_redundant_experts must be <= 8"),
])
def test_bad_layouts_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ParallelConfigError, match=message):
        ParallelLayout(**kwargs)


def test_layout_groups_and_ranks() -> None:
    layout = ParallelLayout(world_size=4, rank=3, ep=2, dp=4, num_experts=8, num_redundant_experts=2)
    assert layout.ep_group_ranks == [[0, 1], [2, 3]]
    assert (layout.ep_rank, layout.dp_rank, layout.slots_per_rank, layout.tokens_replicated) == (1, 3, 5, False)
    assert ParallelLayout(world_size=4, rank=2, ep=4, dp=1, num_experts=8).tokens_replicated


def _groups(rank: int, world: int, layout_world: int, ep: int) -> list[float]:
    layout = ParallelLayout(world_size=layout_world, rank=rank, ep=ep, dp=layout_world, num_experts=8)
    groups = ParallelGroups.create(layout, CpuBackend())
    value = torch.tensor([float(rank)])
    groups.ep.all_reduce(value)
    return [groups.ep.rank, groups.ep.world_size, float(value)]


def test_ep_groups_of_consecutive_ranks() -> None:
    results = spawn(_groups, 4, CpuBackend(), args=(4, 2), timeout_s=40)
    assert results == [[0, 2, 1.0], [1, 2, 1.0], [0, 2, 5.0], [1, 2, 5.0]]


def test_layout_for_another_world_size_fails_on_every_rank() -> None:
    with pytest.raises(RankFailed, match=r"process group has 2 ranks but the layout expects world_size=4"):
        spawn(_groups, 2, CpuBackend(), args=(4, 2), timeout_s=40)


def _dies_mid_run(rank: int, world: int) -> None:
    config = tiny_config()
    moe = random_moe(config, SCORE_LAYER, seed=3)
    layer = ExpertParallelMoE(moe, 0, ExpertPlacement.contiguous(1, 8, world), CpuBackend().communicator())
    x, ids = random_tokens(config, 6, seed=rank)
    layer(x, ids)
    if rank == 1:
        os._exit(3)
    for _ in range(100):
        layer(x, ids)


def _rank1_stalls(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(600)
    CpuBackend().communicator().barrier()


def _every_rank_stalls(rank: int, world: int) -> None:
    time.sleep(600)


def test_a_rank_dying_mid_run_stops_the_run_with_its_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 of 2 exited with code 3"):
        spawn(_dies_mid_run, 2, CpuBackend(), timeout_s=45)
    assert time.monotonic() - start < 45


def test_a_peer_stalling_fails_the_waiting_rank_at_the_group_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 0 raised:(.|\n)*Timed out"):
        spawn(_rank1_stalls, 2, CpuBackend(), timeout_s=6)
    assert time.monotonic() - start < 30


def test_ranks_stalling_outside_collectives_time_out_instead_of_blocking() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"ranks \[0, 1\] of 2 had not finished within timeout_s=4s of joining"):
        spawn(_every_rank_stalls, 2, CpuBackend(), timeout_s=4)
    assert time.monotonic() - start < 30


def test_torchrun_environment_joins_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    try:
        assert init_from_env(CpuBackend(), timeout_s=20) == (0, 1)
    finally:
        dist.destroy_process_group()
