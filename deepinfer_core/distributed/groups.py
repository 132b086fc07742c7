"""Which ranks form which parallel group: attention data parallelism (DP) and expert parallelism (EP).

Ranks are numbered 0..world_size-1. Attention is either replicated (dp = 1: every rank runs the same
requests) or data-parallel over every rank (dp = world_size: each rank owns its requests and its KV
cache). MoE layers are expert-parallel over groups of `ep` consecutive ranks; each group holds every
expert once plus `num_redundant_experts` extra copies, `(n_routed_experts + num_redundant_experts) / ep`
expert slots a rank. Context parallelism (cp > 1) is its own layout: every rank runs the same
requests and splits each step's rows (`context_parallel.py`); it is not combined with ep or dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from deepinfer_core.platform.interfaces import Backend, Communicator

from .errors import ParallelConfigError

__all__ = ["ParallelGroups", "ParallelLayout"]


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    world_size: int
    rank: int
    ep: int
    dp: int
    num_experts: int
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        w = self.world_size
        checks = [
            (w >= 1, "world_size", f"must be >= 1, found {w}"),
            (0 <= self.rank < w, "rank", f"must be in [0, {w}), found {self.rank}"),
            (self.ep >= 1 and w % self.ep == 0, "ep",
             f"must divide world_size={w} (EP groups are {self.ep} consecutive ranks), found {self.ep}"),
            (self.dp in (1, w), "dp",
             f"must be 1 (attention replicated on every rank) or world_size={w} (each rank owns its "
             f"requests), found {self.dp}"),
            (self.num_redundant_experts >= 0, "num_redundant_experts", f"must be >= 0, found {self.num_redundant_experts}"),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ParallelConfigError(f"parallel `{name}` {detail}")
        slots = self.num_experts + self.num_redundant_experts
        if slots % self.ep:
            raise ParallelConfigError(
                f"n_routed_experts={self.num_experts} + num_redundant_experts={self.num_redundant_experts} = "
                f"{slots} expert slots cannot be split evenly over ep={self.ep} ranks: choose ep dividing "
                f"{slots}, or add redundant experts to reach a multiple of {self.ep}"
            )
        if slots // self.ep > self.num_experts:
            raise ParallelConfigError(
                f"{slots // self.ep} slots a rank but only {self.num_experts} experts: a rank never holds "
                f"one expert twice, so num_redundant_experts must be <= {self.num_experts * (self.ep - 1)}"
            )

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.num_redundant_experts) // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def ep_group_ranks(self) -> list[list[int]]:
        return [list(range(start, start + self.ep)) for start in range(0, self.world_size, self.ep)]

    @property
    def dp_rank(self) -> int:
        return self.rank if self.dp > 1 else 0

    @property
    def tokens_replicated(self) -> bool:
        """Whether the ranks of an EP group see the same tokens (attention not data-parallel)."""
        return self.dp == 1 and self.ep > 1


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    layout: ParallelLayout
    world: Communicator
    ep: Communicator

    @classmethod
    def create(cls, layout: ParallelLayout, backend: Backend) -> "ParallelGroups":
        """Communicators for this rank. Collective: every rank must call it, in the same order."""
        if dist.get_world_size() != layout.world_size:
            raise ParallelConfigError(
                f"the process group has {dist.get_world_size()} ranks but the layout expects "
                f"world_size={layout.world_size}: launch one process per rank"
            )
        world = backend.communicator(None)
        if layout.ep == layout.world_size:
            return cls(layout, world, world)
        # NOTE: new_group is itself collective: every rank creates every group, in the same order.
        mine = None
        for ranks in layout.ep_group_ranks:
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                mine = group
        return cls(layout, world, backend.communicator(mine))
