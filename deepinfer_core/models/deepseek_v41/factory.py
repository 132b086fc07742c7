"""Builds V4.1 parameter holders: fp8 32x32 block weights and fp4 experts when the checkpoint is quantised."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.factory import ExpertFilter, RMSNorm
from deepinfer_core.models.deepseek_v4.linear import Linear, WeightFormat, empty_param
from deepinfer_core.platform.kernel_ops import KernelOps

from .config import DeepseekV41Config, DeepseekV41TextConfig
from .kv_quant import KvQuantizer
from .trace import Trace

__all__ = ["ModuleFactory"]


@dataclass(frozen=True, slots=True)
class ModuleFactory:
    """Same interface as V4's factory (so V4's `Expert` builds from it), plus V4.1's shared helpers."""

    full_config: DeepseekV41Config
    ops: KernelOps
    dtype: torch.dtype
    device: torch.device
    kv: KvQuantizer
    trace: Trace
    expert_filter: ExpertFilter | None = None

    @property
    def config(self) -> DeepseekV41TextConfig:
        return self.full_config.text_config

    def holds_expert(self, layer_idx: int, expert: int) -> bool:
        return self.expert_filter is None or self.expert_filter(layer_idx, expert)

    def linear(self, in_features: int, out_features: int, *, quantizable: bool, expert: bool = False) -> Linear:
        """A projection; `quantizable` marks those the release stores in fp8 (MODEL_SPEC_V41 §13)."""
        quant = self.full_config.quantization_config
        fmt: WeightFormat = "dense"
        if quant is not None and expert and getattr(quant, "expert_dtype", None) == "fp4":
            fmt = "fp4"
        elif quant is not None and quantizable:
            fmt = "fp8"
        block = tuple(quant.weight_block_size) if quant is not None else (32, 32)
        return Linear(in_features, out_features, self.ops, dtype=self.dtype, device=self.device, fmt=fmt, block=block)

    def param(self, *shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
        return empty_param(shape, dtype or self.dtype, self.device)

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.ops, self.config.rms_norm_eps, self.device)
