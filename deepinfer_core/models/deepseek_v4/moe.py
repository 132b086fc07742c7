"""Mixture of experts: hash- or score-routed experts plus one shared expert (clamped SwiGLU)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.model_config import LayerSpec
from deepinfer_core.platform.kernel_ops import MlpWeights

from .factory import ModuleFactory

__all__ = ["Gate", "Expert", "MoE", "share_one_storage"]


class Gate(nn.Module):
    """Router weights; `bias` (selection-only correction) on score layers, `tid2eid` on hash layers."""

    def __init__(self, f: ModuleFactory, hashed: bool) -> None:
        super().__init__()
        c = f.config
        self.weight = f.param(c.n_routed_experts, c.hidden_size)
        if hashed:
            self.register_buffer(
                "tid2eid", torch.empty(c.vocab_size, c.num_experts_per_tok, dtype=torch.int64, device=f.device)
            )
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = f.param(c.n_routed_experts, dtype=torch.float32)


class Expert(nn.Module):
    def __init__(self, f: ModuleFactory, routed: bool) -> None:
        super().__init__()
        c = f.config
        self.w1 = f.linear(c.hidden_size, c.moe_intermediate_size, quantizable=True, expert=routed)
        self.w3 = f.linear(c.hidden_size, c.moe_intermediate_size, quantizable=True, expert=routed)
        self.w2 = f.linear(c.moe_intermediate_size, c.hidden_size, quantizable=True, expert=routed)

    def weights(self) -> MlpWeights:
        return MlpWeights(
            self.w1.weight, self.w3.weight, self.w2.weight,
            self.w1.scale, self.w3.scale, self.w2.scale, self.w1.block,
        )


class MoE(nn.Module):
    def __init__(self, f: ModuleFactory, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.config = f.ops, c
        self.gate = Gate(f, hashed=spec.mlp == "hash_moe")
        # Keyed by expert index so names stay `experts.{e}.w1.weight` when a rank holds only some.
        self.experts = nn.ModuleDict({
            str(e): Expert(f, routed=True) for e in range(c.n_routed_experts) if f.holds_expert(layer_idx, e)
        })
        share_one_storage(list(self.experts.values()))
        self.shared_experts = Expert(f, routed=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed experts this rank holds plus the shared expert (expert parallelism sums over ranks)."""
        c = self.config
        weights, ids = self.ops.route(
            x, self.gate.weight, c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func,
            bias=self.gate.bias, tid2eid=self.gate.tid2eid, input_ids=input_ids,
        )
        held = {int(e): expert.weights() for e, expert in self.experts.items()}
        experts = [held.get(e) for e in range(c.n_routed_experts)]
        return self.ops.fused_moe(x, weights, ids, experts, self.shared_experts.weights(), c.swiglu_limit)


def share_one_storage(experts: list[Expert]) -> None:
    """Re-point each expert's tensors at slices of one stacked [E, N, K] tensor per projection, their values
    copied in.

    Names stay `experts.{e}.w1.weight` (the loader's in-place copy fills the stack), and grouped-GEMM
    kernels read the stack without copying it (a backend given experts in separate tensors stacks a copy:
    twice the expert memory). Every model with routed experts calls it on the ones it holds, and expert
    parallelism again when a rank's experts change: the stack then holds those alone, and the old one (with
    the experts the rank gave up) is freed.
    """
    if not experts:
        return
    for proj in ("w1", "w3", "w2"):
        for attr in ("weight", "scale"):
            first = getattr(getattr(experts[0], proj), attr)
            if first is None:
                continue
            stack = torch.empty((len(experts), *first.shape), dtype=first.dtype, device=first.device)
            for i, expert in enumerate(experts):
                stack[i].copy_(getattr(getattr(expert, proj), attr))
                setattr(getattr(expert, proj), attr, nn.Parameter(stack[i], requires_grad=False))
