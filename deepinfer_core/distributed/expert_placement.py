"""Which EP rank holds which expert, per MoE layer, and EPLB: a placement that balances tokens per rank.

A placement gives every MoE layer `ep * slots_per_rank` physical expert slots; slot s lives on EP rank
s // slots_per_rank and holds logical expert `slot_experts[layer, s]`. Every expert has at least one
slot; `num_redundant_experts` slots hold extra copies of busy experts, and a token routed to an expert
with several copies goes to one of them (spread evenly), so each copy carries load / copies.

EPLB (`ExpertPlacement.balanced`), per layer, from observed per-expert token counts:
1. Replication: start with one copy of every expert; give each redundant slot, one at a time, to the
   expert with the largest load per copy (ties: lower expert id) that has fewer than `ep` copies.
2. Packing: sort the copies by load per copy, heaviest first (ties: lower expert id), and put each on
   the rank with the least load so far among those with a free slot that do not yet hold that expert
   (ties: lower rank). This is greedy longest-processing-time packing with a slot limit per rank:
   the heaviest rank typically ends within one copy's load of the mean.
   If every rank with a free slot already holds the expert, the copy goes instead to the expert with
   the largest load per copy that such a rank lacks (so every slot stays useful).
The placement is global (one level: all ranks of an EP group are alike); it is a pure function of the
loads, so every rank computes the same one from the same (all-reduced) statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.platform.interfaces import Communicator

from .errors import PlacementError

__all__ = ["ExpertLoad", "ExpertPlacement", "rank_imbalance"]


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    num_experts: int
    ep: int
    slot_experts: torch.Tensor  # [num_layers, ep * slots_per_rank] int64, on the host

    def __post_init__(self) -> None:
        layers, slots = self.slot_experts.shape
        if slots % self.ep:
            raise PlacementError(f"{slots} slots a layer cannot be split over ep={self.ep} ranks")
        for layer in range(layers):
            row = self.slot_experts[layer]
            if row.min() < 0 or row.max() >= self.num_experts:
                raise PlacementError(f"layer {layer}: slot experts must be in [0, {self.num_experts}), found {row.tolist()}")
            missing = sorted(set(range(self.num_experts)) - set(row.tolist()))
            if missing:
                raise PlacementError(f"layer {layer}: experts {missing} have no slot; every expert needs one")
            for rank in range(self.ep):
                held = self.rank_experts(layer, rank)
                if len(set(held)) != len(held):
                    raise PlacementError(f"layer {layer}: rank {rank} holds an expert twice: {held}")

    @property
    def num_layers(self) -> int:
        return self.slot_experts.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.slot_experts.shape[1] // self.ep

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """The experts in `rank`'s slots, in slot order."""
        start = rank * self.slots_per_rank
        return self.slot_experts[layer, start : start + self.slots_per_rank].tolist()

    def holds(self, layer: int, rank: int, expert: int) -> bool:
        return expert in self.rank_experts(layer, rank)

    def replicas(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [E, max_copies] int64, -1 padded, in slot order; copies [E] int64) of one layer."""
        row = self.slot_experts[layer]
        copies = torch.bincount(row, minlength=self.num_experts)
        table = torch.full((self.num_experts, int(copies.max())), -1, dtype=torch.int64)
        filled = [0] * self.num_experts
        for slot, expert in enumerate(row.tolist()):
            table[expert, filled[expert]] = slot
            filled[expert] += 1
        return table, copies

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, ep: int) -> "ExpertPlacement":
        """No redundancy: rank r holds experts r*E/ep .. (r+1)*E/ep - 1 on every layer."""
        if num_experts % ep:
            raise PlacementError(f"{num_experts} experts cannot be split over ep={ep} ranks without redundant slots")
        return cls(num_experts, ep, torch.arange(num_experts).repeat(num_layers, 1))

    @classmethod
    def initial(cls, num_layers: int, num_experts: int, ep: int, num_redundant_experts: int) -> "ExpertPlacement":
        """The placement before any load is observed: contiguous, or balanced for a uniform load."""
        if num_redundant_experts == 0:
            return cls.contiguous(num_layers, num_experts, ep)
        return cls.balanced(torch.ones(num_layers, num_experts), ep, num_redundant_experts)

    @classmethod
    def balanced(cls, loads: torch.Tensor, ep: int, num_redundant_experts: int) -> "ExpertPlacement":
        """The EPLB placement (module docstring) for `loads` [num_layers, E] tokens per expert."""
        num_layers, num_experts = loads.shape
        loads = loads.detach().to("cpu", torch.float64)
        slots = num_experts + num_redundant_experts
        if slots % ep or slots // ep > num_experts:
            raise PlacementError(
                f"{num_experts} experts + {num_redundant_experts} redundant cannot fill ep={ep} ranks evenly "
                "with distinct experts per rank"
            )
        rows = [_balance_layer(loads[layer], ep, slots // ep) for layer in range(num_layers)]
        return cls(num_experts, ep, torch.tensor(rows, dtype=torch.int64))

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """Expected tokens per rank [num_layers, ep] when each expert's load splits evenly over its copies."""
        loads = loads.detach().to("cpu", torch.float64)
        out = torch.zeros(self.num_layers, self.ep, dtype=torch.float64)
        for layer in range(self.num_layers):
            copies = torch.bincount(self.slot_experts[layer], minlength=self.num_experts).double()
            per_slot = loads[layer][self.slot_experts[layer]] / copies[self.slot_experts[layer]]
            out[layer] = per_slot.view(self.ep, self.slots_per_rank).sum(dim=1)
        return out


def rank_imbalance(rank_tokens: torch.Tensor) -> float:
    """max / mean of tokens per rank, worst layer: 1.0 is perfect balance. rank_tokens [num_layers, ep]."""
    rank_tokens = rank_tokens.detach().to("cpu", torch.float64)
    mean = rank_tokens.mean(dim=1).clamp(min=1e-12)
    return float((rank_tokens.max(dim=1).values / mean).max())


def _balance_layer(load: torch.Tensor, ep: int, slots_per_rank: int) -> list[int]:
    num_experts = load.shape[0]
    copies = [1] * num_experts
    for _ in range(ep * slots_per_rank - num_experts):
        candidates = [e for e in range(num_experts) if copies[e] < ep]
        best = max(candidates, key=lambda e: (float(load[e]) / copies[e], -e))
        copies[best] += 1
    items = sorted(
        ((float(load[e]) / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
        key=lambda item: (-item[0], item[1]),
    )
    held: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    per_copy = {e: float(load[e]) / copies[e] for e in range(num_experts)}
    for weight, expert in items:
        free = [r for r in range(ep) if len(held[r]) < slots_per_rank]
        fits = [r for r in free if expert not in held[r]]
        if fits:
            rank = min(fits, key=lambda r: (totals[r], r))
        else:
            rank = min(free, key=lambda r: (totals[r], r))
            expert = max((e for e in range(num_experts) if e not in held[rank]), key=lambda e: (per_copy[e], -e))
            weight = per_copy[expert]
        held[rank].append(expert)
        totals[rank] += weight
    return [expert for rank_held in held for expert in rank_held]


@dataclass(slots=True)
class ExpertLoad:
    """Token statistics collected while serving: per-expert routed tokens and per-rank dispatched tokens."""

    expert_tokens: torch.Tensor  # [num_layers, E] int64, (token, expert) pairs routed to each expert
    rank_tokens: torch.Tensor    # [num_layers, ep] int64, (token, expert) pairs sent to each EP rank

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, ep: int, device: torch.device | None = None) -> "ExpertLoad":
        """Counters on `device` (the activations' device: recording then never waits for the host)."""
        return cls(
            torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device),
            torch.zeros(num_layers, ep, dtype=torch.int64, device=device),
        )

    def record(self, layer: int, ids: torch.Tensor, rank_counts: torch.Tensor) -> None:
        self.expert_tokens[layer] += torch.bincount(ids.flatten(), minlength=self.expert_tokens.shape[1])
        self.rank_tokens[layer] += rank_counts

    def reset(self) -> None:
        self.expert_tokens.zero_()
        self.rank_tokens.zero_()

    def summed(self, comm: Communicator) -> "ExpertLoad":
        """The statistics of every rank of `comm` added up (collective)."""
        both = torch.cat([self.expert_tokens, self.rank_tokens], dim=1)
        comm.all_reduce(both)
        experts = self.expert_tokens.shape[1]
        return ExpertLoad(both[:, :experts].clone(), both[:, experts:].clone())
