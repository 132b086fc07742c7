"""The torch.distributed communicator, on two real processes over gloo."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deepinfer_core.platform.distributed_communicator import (
    CommunicatorSetupError,
    DistributedCommunicator,
)
from deepinfer_core.reference.backend import CpuBackend

WORLD = 2
TIMEOUT_S = 120


def _collectives(rank: int) -> None:
    comm = CpuBackend().communicator()
    assert (comm.rank, comm.world_size) == (rank, WORLD)
    gen = torch.Generator().manual_seed(100 + rank)
    mine = torch.randn(4, 6, generator=gen)
    theirs = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + 1 - rank))
    ordered = [mine, theirs] if rank == 0 else [theirs, mine]

    for op, expect in [("sum", mine + theirs), ("max", torch.maximum(mine, theirs)),
                       ("min", torch.minimum(mine, theirs)), ("avg", (mine + theirs) / 2)]:
        tensor = mine.clone()
        comm.all_reduce(tensor, op)
        torch.testing.assert_close(tensor, expect)

    torch.testing.assert_close(comm.all_gather(mine), torch.cat(ordered, 0))
    torch.testing.assert_close(comm.all_gather(mine, dim=1), torch.cat(ordered, 1))

    total = mine + theirs
    torch.testing.assert_close(comm.reduce_scatter(mine), total.chunk(WORLD, 0)[rank])
    torch.testing.assert_close(comm.reduce_scatter(mine, dim=1), total.chunk(WORLD, 1)[rank])

    # EP-style exchange with uneven splits: rank r sends r + 1 rows to rank 0 and 2 - r to rank 1.
    def rows_and_splits(r: int) -> tuple[torch.Tensor, list[int]]:
        return torch.randn(3, 5, generator=torch.Generator().manual_seed(200 + r)), [r + 1, 2 - r]

    rows, splits = rows_and_splits(rank)
    blocks_for_me = [rows_and_splits(r)[0].split(rows_and_splits(r)[1])[rank] for r in range(WORLD)]
    expected = torch.cat(blocks_for_me)
    torch.testing.assert_close(comm.all_to_all(rows, splits), expected)
    known_sizes = [len(block) for block in blocks_for_me]
    torch.testing.assert_close(comm.all_to_all(rows, splits, output_split_sizes=known_sizes), expected)

    tensor = mine.clone()
    comm.broadcast(tensor, src=1)
    torch.testing.assert_close(tensor, mine if rank == 1 else theirs)

    with pytest.raises(CommunicatorSetupError, match="needs 'mpi'"):
        DistributedCommunicator(None, "mpi")
    comm.barrier()


def _worker(rank: int, store: str, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        try:
            _collectives(rank)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def test_collectives_on_two_gloo_processes(tmp_path: Path):
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    store = str(tmp_path / "store")
    procs = [context.Process(target=_worker, args=(rank, store, errors)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.kill()
        proc.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not hung, f"{len(hung)} rank(s) still running after {TIMEOUT_S}s"
    assert not failures, "\n".join(failures)
    assert [proc.exitcode for proc in procs] == [0] * WORLD


def test_communicator_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(CommunicatorSetupError, match="init_process_group.*'gloo'"):
        CpuBackend().communicator()
