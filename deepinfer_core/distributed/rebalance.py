"""Apply a new expert placement between steps: move expert weights between ranks, no restart.

For every MoE layer, each expert a rank gains comes from the lowest rank that held it under the old
placement, through one `all_to_all` per expert tensor (w1/w3/w2 weights, and their scales when
quantised), sent as raw bytes so every weight format travels unchanged. Experts a rank keeps are not
copied; experts it loses are dropped. Every rank must call `rebalance_experts` at the same point
between two steps, with the same new placement (a pure function of all-reduced load statistics).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.moe import share_one_storage

from .ep_moe import ExpertParallelMoE
from .errors import PlacementError
from .expert_placement import ExpertPlacement

__all__ = ["rebalance_experts"]


def rebalance_experts(layers: list[ExpertParallelMoE], placement: ExpertPlacement) -> None:
    """Move weights so each layer holds its share of `placement`, then route by it (collective)."""
    if placement.num_layers != len(layers):
        raise PlacementError(f"the placement covers {placement.num_layers} MoE layers, the model has {len(layers)}")
    for layer in layers:
        _rebalance_layer(layer, placement)


def _rebalance_layer(layer: ExpertParallelMoE, new: ExpertPlacement) -> None:
    old, comm, index = layer.placement, layer.comm, layer.layer
    if (new.num_experts, new.ep) != (old.num_experts, old.ep):
        raise PlacementError(
            f"a new placement must keep {old.num_experts} experts over ep={old.ep}; found "
            f"{new.num_experts} over ep={new.ep}"
        )
    me, ranks = comm.rank, range(comm.world_size)
    old_held = [set(old.rank_experts(index, r)) for r in ranks]
    source = {e: min(r for r in ranks if e in old_held[r]) for e in range(old.num_experts)}
    gains = [sorted(set(new.rank_experts(index, r)) - old_held[r]) for r in ranks]
    sends = [[e for e in gains[r] if source[e] == me] for r in ranks]
    receives = [[e for e in gains[me] if source[e] == r] for r in ranks]

    template = next(iter(layer.experts.values()))
    arriving = {e: _empty_like(template, layer) for e in gains[me]}
    for name, like in template.state_dict().items():
        outgoing = [layer.experts[str(e)].state_dict()[name] for r in ranks for e in sends[r]]
        payload = _as_bytes(outgoing, like)
        got = comm.all_to_all(payload, [len(s) for s in sends], [len(s) for s in receives])
        incoming = [e for r in ranks for e in receives[r]]
        for row, expert in zip(got, incoming):
            arriving[expert].state_dict()[name].copy_(row.view(like.dtype).view(like.shape))

    kept = {e: layer.experts[str(e)] for e in new.rank_experts(index, me) if e in old_held[me]}
    layer.experts = nn.ModuleDict(
        {str(e): kept[e] if e in kept else arriving[e] for e in new.rank_experts(index, me)}
    )
    if arriving or len(kept) < len(old_held[me]):  # one stack again: the old one goes with the experts given up
        share_one_storage(list(layer.experts.values()))
    layer.use_placement(new)


def _empty_like(template: nn.Module, layer: ExpertParallelMoE) -> nn.Module:
    """An expert of the template's structure and weight formats (its values are overwritten)."""
    return copy.deepcopy(template, memo={id(layer.ops): layer.ops})


def _as_bytes(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    # NOTE: bytes, because collective libraries do not all carry fp8 / e8m0 dtypes.
    width = like.numel() * like.element_size()
    if not tensors:
        return torch.empty((0, width), dtype=torch.uint8, device=like.device)
    return torch.stack([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
