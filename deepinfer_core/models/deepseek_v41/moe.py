"""V4.1 MoE (MODEL_SPEC_V41 §7): float32 router with gate_temp, weight applied before w2, one shared expert."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.moe import Expert
from .factory import ModuleFactory

__all__ = ["Gate", "MoE"]


class Gate(nn.Module):
    """Router weight [E, D]; `bias` selects for text tokens, `bias_vl` for image-span tokens (float32)."""

    def __init__(self, f: ModuleFactory) -> None:
        super().__init__()
        c = f.config
        self.weight = f.param(c.n_routed_experts, c.hidden_size)
        self.bias = f.param(c.n_routed_experts, dtype=torch.float32)
        self.bias_vl = f.param(c.n_routed_experts, dtype=torch.float32)


class MoE(nn.Module):
    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.config, self.trace, self.layer = f.ops, c, f.trace, layer
        self.gate = Gate(f)
        self.experts = nn.ModuleList(Expert(f, routed=True) for _ in range(c.n_routed_experts))
        self.shared_experts = Expert(f, routed=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = self.ops.route_fp32(
            x, self.gate.weight, self.gate.bias, c.num_experts_per_tok, c.routed_scaling_factor, c.gate_temp
        )
        self.trace.record(f"router_indices.layer{self.layer}", ids)
        self.trace.record(f"router_weights.layer{self.layer}", weights)
        experts = [expert.weights() for expert in self.experts]
        return self.ops.fused_moe_prescaled(x, weights, ids, experts, self.shared_experts.weights(), c.swiglu_limit)
