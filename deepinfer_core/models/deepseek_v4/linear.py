"""A projection's parameters as the checkpoint stores them: `weight` (+ `scale` when quantised)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = ["Linear", "WeightFormat", "empty_param"]

WeightFormat = Literal["dense", "fp8", "fp4"]


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised storage the weight loader fills by name."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T through `KernelOps.linear`; fp8 holds e4m3 [N, K] + e8m0 block scales, fp4 packed int8
    [N, K/2] + e8m0 scales [N, K/32]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ops: KernelOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        fmt: WeightFormat = "dense",
        block: tuple[int, int] = (128, 128),
    ) -> None:
        super().__init__()
        self.ops = ops
        self.block: tuple[int, int] | None = None
        if fmt == "fp8":
            self.block = tuple(block)
            self.weight = empty_param((out_features, in_features), torch.float8_e4m3fn, device)
            scale_shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
            self.scale = empty_param(scale_shape, torch.float8_e8m0fnu, device)
        elif fmt == "fp4":
            self.weight = empty_param((out_features, in_features // 2), torch.int8, device)
            self.scale = empty_param((out_features, math.ceil(in_features / 32)), torch.float8_e8m0fnu, device)
        else:
            self.weight = empty_param((out_features, in_features), dtype, device)
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.scale, self.block)
