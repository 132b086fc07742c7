"""A projection's parameters as the checkpoint stores them: `weight` (+ `scale` when quantised)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = ["Linear", "LinearGroup", "WeightFormat", "empty_param"]

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


class LinearGroup(nn.Module):
    """Projections of one input, run as few `KernelOps.linear` launches as their formats allow: at a
    decode step each launch costs more than its small weight takes to read.

    The parts stay their parents' own `Linear`s (the loader fills each by its name); built before the
    weights load, the group re-points each part's weight and scale at rows of one tensor per format, so
    the parts and the group share memory. Parts of another format, block or input width, and fp8 parts
    whose rows are not whole scale blocks, take a tensor (a launch) of their own. The group registers
    no part and no tensor: the state dict keeps the parts' names."""

    def __init__(self, *parts: Linear) -> None:
        super().__init__()
        self.ops = parts[0].ops
        self._stacks: list[tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None, list[int]]] = []
        self._order: list[tuple[int, int]] = []  # part i -> (its stack, its place in that stack's split)
        members: dict[tuple, list[Linear]] = {}
        for part in parts:
            key = _stack_key(part)
            members.setdefault(key, []).append(part)
            self._order.append((list(members).index(key), len(members[key]) - 1))
        for group in members.values():
            self._stacks.append((_stack_rows(group, "weight"), _stack_rows(group, "scale"), group[0].block,
                                 [p.weight.shape[0] for p in group]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each part's x W^T, in the parts' order (views of one output per stack)."""
        outs = [self.ops.linear(x, w, s, block).split(sizes, dim=-1) for w, s, block, sizes in self._stacks]
        return tuple(outs[stack][i] for stack, i in self._order)


def _stack_key(part: Linear) -> tuple:
    """Parts of equal keys share a tensor; an fp8 part of rows that are not whole scale blocks gets a key
    of its own."""
    if part.block is not None and part.weight.shape[0] % part.block[0]:
        return ("alone", id(part))
    scale = part.scale
    return (part.weight.dtype, tuple(part.weight.shape[1:]), part.block,
            None if scale is None else (scale.dtype, tuple(scale.shape[1:])))


def _stack_rows(parts: list[Linear], name: str) -> torch.Tensor | None:
    """One tensor holding the parts' `name` tensors as consecutive rows; each part's becomes a view of it."""
    first = getattr(parts[0], name)
    if first is None:
        return None
    rows = [getattr(p, name).shape[0] for p in parts]
    stack = torch.empty((sum(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
    for part, view in zip(parts, stack.split(rows)):
        setattr(part, name, nn.Parameter(view, requires_grad=False))
    return stack
