"""Builds the model's parameter holders with the dtype and weight format the config decides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.model_config import DeepseekV4Config
from deepinfer_core.platform.kernel_ops import KernelOps

from .linear import Linear, WeightFormat, empty_param

__all__ = ["ExpertFilter", "ModuleFactory", "RMSNorm"]

# (block index, expert index) -> whether this rank holds the routed expert; MTP block k is
# num_hidden_layers + k (the loader's `expert_filter` convention).
ExpertFilter = Callable[[int, int], bool]


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is float32 whatever the compute dtype."""

    def __init__(self, dim: int, ops: KernelOps, eps: float, device: torch.device) -> None:
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = empty_param((dim,), torch.float32, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class ModuleFactory:
    config: DeepseekV4Config
    ops: KernelOps
    dtype: torch.dtype
    device: torch.device
    expert_filter: ExpertFilter | None = None

    def holds_expert(self, layer_idx: int, expert: int) -> bool:
        return self.expert_filter is None or self.expert_filter(layer_idx, expert)

    def linear(self, in_features: int, out_features: int, *, quantizable: bool, expert: bool = False) -> Linear:
        """A projection; `quantizable` marks those the release stores in fp8 (MODEL_SPEC §8)."""
        quant = self.config.quantization_config
        fmt: WeightFormat = "dense"
        if expert and self.config.expert_dtype == "fp4":
            fmt = "fp4"
        elif quantizable and quant is not None:
            fmt = "fp8"
        block = quant.weight_block_size if quant is not None else (128, 128)
        return Linear(in_features, out_features, self.ops, dtype=self.dtype, device=self.device, fmt=fmt, block=block)

    def param(self, *shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
        return empty_param(shape, dtype or self.dtype, self.device)

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.ops, self.config.rms_norm_eps, self.device)
