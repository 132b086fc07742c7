"""V4.1 MoE (MODEL_SPEC_V41 §7): float32 router with gate_temp, weight applied before w2, one shared expert."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.moe import Expert, share_one_storage
from deepinfer_core.platform.kernel_ops import KernelOps

from .config import DeepseekV41TextConfig
from .factory import ModuleFactory

__all__ = ["Gate", "MoE", "route"]


class Gate(nn.Module):
    """Router weight [E, D]; `bias` selects for text tokens, `bias_vl` for image-span tokens (float32)."""

    def __init__(self, f: ModuleFactory) -> None:
        super().__init__()
        c = f.config
        self.weight = f.param(c.n_routed_experts, c.hidden_size)
        self.bias = f.param(c.n_routed_experts, dtype=torch.float32)
        self.bias_vl = f.param(c.n_routed_experts, dtype=torch.float32)


def route(
    ops: KernelOps, gate: Gate, c: DeepseekV41TextConfig, x: torch.Tensor, image_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k]) of `route_fp32`; rows in `image_rows` (image-span tokens)
    select with `gate.bias_vl` instead of `gate.bias` (the router is row-wise, so routing them apart is exact)."""
    k, scale, temp = c.num_experts_per_tok, c.routed_scaling_factor, c.gate_temp
    weights, ids = ops.route_fp32(x, gate.weight, gate.bias, k, scale, temp)
    if image_rows is None:
        return weights, ids
    vl_weights, vl_ids = ops.route_fp32(x[image_rows], gate.weight, gate.bias_vl, k, scale, temp)
    return weights.index_copy(0, image_rows, vl_weights), ids.index_copy(0, image_rows, vl_ids)


class MoE(nn.Module):
    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.config, self.trace, self.layer = f.ops, c, f.trace, layer
        self.gate = Gate(f)
        # Keyed by expert index, as V4's, so a rank built with an expert filter keeps the official names.
        self.experts = nn.ModuleDict({
            str(e): Expert(f, routed=True) for e in range(c.n_routed_experts) if f.holds_expert(layer, e)
        })
        share_one_storage(list(self.experts.values()))
        self.shared_experts = Expert(f, routed=False)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D]; `image_rows` int64: rows that are image-span tokens (routed with `bias_vl`)."""
        c = self.config
        weights, ids = route(self.ops, self.gate, c, x, image_rows)
        self.trace.record(f"router_indices.layer{self.layer}", ids)
        self.trace.record(f"router_weights.layer{self.layer}", weights)
        held = {int(e): expert.weights() for e, expert in self.experts.items()}
        experts = [held.get(e) for e in range(c.n_routed_experts)]
        return self.ops.fused_moe_prescaled(x, weights, ids, experts, self.shared_experts.weights(), c.swiglu_limit)
