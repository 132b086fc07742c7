"""Expert-parallel MoE: a layer's experts spread over the ranks of an EP group, tokens sent to them.

Applied after the model is built (`apply_expert_parallel`): each block's `ffn` (a `MoE`) is replaced
by an `ExpertParallelMoE` that reuses its router, shared expert and the experts this rank holds, under
the same parameter names (`layers.{i}.ffn.experts.{e}.w1.weight`). Build the model with
`expert_filter=expert_filter(placement, rank)` so it allocates only those experts, and load it with the
same filter so the loader reads nothing else.

One forward, per rank:
1. route this rank's tokens (router replicated on every rank);
2. dispatch: every (token, expert) pair goes, by `all_to_all` with variable splits, to the rank
   holding a copy of its expert (a pair picks among an expert's copies by its row, so copies share
   the load);
3. the receiving rank runs its experts on the pairs it got through `KernelOps.fused_moe` (one expert a
   row, no shared term), each output already multiplied by its routing weight;
4. combine: the outputs return by `all_to_all`; each token adds its pairs in ascending expert id, then
   the shared expert (`fused_moe` with no routed expert held), which is exactly the order
   `KernelOps.fused_moe` sums in, so the result does not depend on how many ranks there are (bitwise,
   when the backend's GEMMs are batch-invariant).
Ranks with no tokens still take part in every collective.

With `tokens_replicated` (attention not data-parallel: every rank of the group has the same tokens)
each rank takes a contiguous share of the rows through the steps above and the shares are all-gathered.

Both model families are served: V4's MoE (`route` + `fused_moe`, sums in the activation dtype) and
V4.1's (`route_fp32` + `fused_moe_prescaled`, sums in float32; its shared expert comes back from the op
already rounded to the activation dtype, one extra rounding in bfloat16, none in float32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.moe import MoE, share_one_storage
from deepinfer_core.models.deepseek_v41.moe import MoE as MoEV41
from deepinfer_core.models.deepseek_v41.moe import route as route_v41
from deepinfer_core.platform.interfaces import Communicator
from deepinfer_core.platform.kernel_ops import MlpWeights

from .errors import ParallelConfigError, PlacementError
from .expert_placement import ExpertLoad, ExpertPlacement

__all__ = ["ExpertParallelMoE", "apply_expert_parallel", "expert_filter", "join_without_tokens", "moe_layers"]


class ExpertParallelMoE(nn.Module):
    def __init__(
        self,
        moe: MoE | MoEV41,
        layer: int,
        placement: ExpertPlacement,
        comm: Communicator,
        *,
        tokens_replicated: bool = False,
        load: ExpertLoad | None = None,
    ) -> None:
        super().__init__()
        if placement.ep != comm.world_size:
            raise ParallelConfigError(
                f"the placement spreads experts over ep={placement.ep} ranks but the EP communicator has "
                f"{comm.world_size}: build the placement for the EP group size"
            )
        self.ops, self.config, self.layer, self.comm = moe.ops, moe.config, layer, comm
        self.tokens_replicated, self.load = tokens_replicated, load
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        held = placement.rank_experts(layer, comm.rank)
        missing = [] if isinstance(moe.experts, nn.ModuleList) else [e for e in held if str(e) not in moe.experts]
        if missing:
            raise PlacementError(
                f"layer {layer} rank {comm.rank}: the placement gives experts {held} but the model was built "
                f"without {missing}; build it with expert_filter=expert_filter(placement, rank) (or with all experts)"
            )
        self.experts = nn.ModuleDict({str(e): _expert(moe, e) for e in held})
        if len(held) < len(moe.experts):  # built with every expert: the held ones in a stack of their own
            share_one_storage(list(self.experts.values()))
        self.prescaled = isinstance(moe, MoEV41)
        self._no_experts: list[MlpWeights | None] = [None] * moe.config.n_routed_experts
        self.use_placement(placement)

    def use_placement(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from the next forward on; `experts` must already hold this rank's share."""
        held = placement.rank_experts(self.layer, self.comm.rank)
        if sorted(held) != sorted(int(e) for e in self.experts):
            raise PlacementError(
                f"layer {self.layer} rank {self.comm.rank}: the placement gives experts {held} but the layer "
                f"holds {sorted(int(e) for e in self.experts)}; move the weights first (rebalance_experts)"
            )
        self.placement, self._held = placement, held
        device = self.gate.weight.device
        table, copies = placement.replicas(self.layer)
        self._slot_table, self._copies = table.to(device), copies.to(device)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, image_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, D]; `input_ids` [T] feed V4's hash routing (V4.1 blocks pass none); `image_rows`: V4.1's
        image-span rows (routed with `bias_vl`)."""
        if not self.tokens_replicated:
            return self._moe(x, input_ids, image_rows)
        share = -(-x.shape[0] // self.comm.world_size)
        mine = slice(self.comm.rank * share, (self.comm.rank + 1) * share)
        my_image_rows = None
        if image_rows is not None:
            inside = (image_rows >= mine.start) & (image_rows < mine.stop)
            my_image_rows = image_rows[inside] - mine.start
        out = self._moe(x[mine], None if input_ids is None else input_ids[mine], my_image_rows)
        padded = out.new_zeros((share, x.shape[1]))
        padded[: out.shape[0]] = out
        return self.comm.all_gather(padded)[: x.shape[0]]

    def _route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, image_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, gate = self.config, self.gate
        if self.prescaled:
            return route_v41(self.ops, gate, c, x, image_rows)
        return self.ops.route(
            x, gate.weight, c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func,
            bias=gate.bias, tid2eid=gate.tid2eid, input_ids=input_ids,
        )

    def _moe(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, image_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        c, ops, comm = self.config, self.ops, self.comm
        experts_op = ops.fused_moe_prescaled if self.prescaled else ops.fused_moe
        weights, ids = self._route(x, input_ids, image_rows)
        tokens, k = ids.shape
        per_rank = self.placement.slots_per_rank
        slots = self._pick_slots(ids).flatten()
        dest = slots // per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=comm.world_size)
        recv_counts = comm.all_to_all(send_counts, [1] * comm.world_size, [1] * comm.world_size)
        sent, received = send_counts.tolist(), recv_counts.tolist()

        recv_x = comm.all_to_all(x[order // k], sent, received)
        # One message for each pair's weight and local slot: float64 holds both exactly.
        meta = torch.stack([weights.flatten()[order].double(), (slots[order] % per_rank).double()], dim=1)
        recv_meta = comm.all_to_all(meta, sent, received)
        recv_w, recv_slot = recv_meta[:, 0].float(), recv_meta[:, 1].long()
        local = [self.experts[str(e)].weights() for e in self._held]
        y = experts_op(recv_x, recv_w[:, None], recv_slot[:, None], local, None, c.swiglu_limit)
        back = comm.all_to_all(y, received, sent)

        pairs = torch.empty_like(back)
        pairs[order] = back
        pairs = pairs.view(tokens, k, x.shape[1])
        rows = torch.arange(tokens, device=x.device)
        routed = torch.zeros(x.shape, dtype=torch.float32 if self.prescaled else x.dtype, device=x.device)
        for j in ids.argsort(dim=1).unbind(1):
            routed += pairs[rows, j]
        if self.load is not None:
            self.load.record(self.layer, ids, send_counts)
        shared = experts_op(x, weights, ids, self._no_experts, self.shared_experts.weights(), c.swiglu_limit)
        return (routed + shared).to(x.dtype)

    def _pick_slots(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        copy = (rows + self.comm.rank) % self._copies[ids]
        return self._slot_table[ids, copy]


def join_without_tokens(layers: list[ExpertParallelMoE]) -> None:
    """Take part in one forward's MoE collectives with no tokens, for a DP rank without requests this
    step: pass the layers the busy ranks' forward runs (main layers; the MTP layer when they draft)."""
    for layer in layers:
        weight = layer.gate.weight
        layer(weight.new_empty((0, weight.shape[1])), torch.empty(0, dtype=torch.int64, device=weight.device))


def _expert(moe: MoE | MoEV41, expert: int) -> nn.Module:
    # V4 keys its experts by index (a rank may hold only some); V4.1 keeps a full list.
    return moe.experts[expert] if isinstance(moe.experts, nn.ModuleList) else moe.experts[str(expert)]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks with an `ffn`, numbered as the loader and the placement number them (main, then MTP)."""
    return [*model.layers, *getattr(model, "mtp", [])]


def apply_expert_parallel(
    model: nn.Module,
    placement: ExpertPlacement,
    comm: Communicator,
    *,
    tokens_replicated: bool = False,
    load: ExpertLoad | None = None,
) -> list[ExpertParallelMoE]:
    """Replace every block's MoE by its expert-parallel form, in place; returns the new layers.

    Call after building the model (with or without `expert_filter(placement, rank)`; experts this rank
    does not hold are dropped here, their memory with them) and before `load_model_weights(..., expert_filter=...)`.
    """
    blocks = moe_layers(model)
    if placement.num_layers != len(blocks):
        raise PlacementError(
            f"the placement covers {placement.num_layers} MoE layers but the model has {len(blocks)} "
            "(main layers plus MTP layers)"
        )
    layers = []
    for index, block in enumerate(blocks):
        block.ffn = ExpertParallelMoE(
            block.ffn, index, placement, comm, tokens_replicated=tokens_replicated, load=load
        )
        layers.append(block.ffn)
    return layers


def expert_filter(placement: ExpertPlacement, ep_rank: int) -> Callable[[int, int], bool]:
    """The loader's `expert_filter`: whether EP rank `ep_rank` holds expert e of MoE layer l."""
    held = [set(placement.rank_experts(layer, ep_rank)) for layer in range(placement.num_layers)]
    return lambda layer, expert: expert in held[layer]
