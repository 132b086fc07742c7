"""`TritonOps`: the reference `KernelOps` with its hot ops replaced by `deepinfer_kernels` Triton kernels.

Kernels are resolved once here (module imports at construction); each override is a plain call.
An op keeps the reference path for the inputs its kernel does not cover (named at each fallback).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights

__all__ = ["TritonOps"]


class TritonOps(KernelOps):
    def __init__(self) -> None:
        from deepinfer_kernels import fused_moe, linear, rms_norm, sparse_attention

        self._rms_norm = rms_norm.rms_norm
        self._linear = linear.linear
        self._linear_supported = linear.linear_supported
        self._moe_routed = fused_moe.moe_routed
        self._stacked_experts = fused_moe.StackedExperts
        self._attention = sparse_attention.sparse_attention
        self._expert_stacks: dict[tuple, fused_moe.StackedExperts] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        block: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        # Fallback: fp8 block shapes that are not powers of two >= 16, fp4 rows that are not whole scale groups.
        if not self._linear_supported(weight, block):
            return super().linear(x, weight, scale, block)
        return self._linear(x, weight, scale, block)

    def grouped_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        block: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        groups = x.shape[1]
        rows = weight.shape[0] // groups
        # Fallback: what `linear` refuses, and fp8 groups that would split a scale block.
        if not self._linear_supported(weight, block) or (block is not None and rows % block[0]):
            return super().grouped_linear(x, weight, scale, block)
        scale_rows = rows // block[0] if weight.dtype == torch.float8_e4m3fn else rows
        outs = [
            self._linear(
                x[:, g], weight[g * rows:(g + 1) * rows],
                None if scale is None else scale[g * scale_rows:(g + 1) * scale_rows], block,
            )
            for g in range(groups)
        ]
        return torch.stack(outs, dim=1)

    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: Sequence[MlpWeights | None],
        shared: MlpWeights | None,
        swiglu_limit: float,
    ) -> torch.Tensor:
        # Expert parallelism calls this with no shared expert (pairs computed for another rank) or
        # with no held expert (a rank that only adds the shared term).
        if any(e is not None for e in experts):
            out = self._moe_routed(x, weights, ids, self._stack(experts, x.device), swiglu_limit)
        else:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if shared is not None:
            out = out + self._swiglu(x, shared, swiglu_limit).float()
        return out.to(x.dtype)

    def sparse_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        window: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        batch: ForwardBatch,
        entries: torch.Tensor | None = None,
        ratio: int = 0,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._attention(q, kv, window, sinks, scale, batch, entries, ratio, selected)

    def _stack(self, experts: Sequence[MlpWeights | None], device: torch.device):
        """The held experts stacked [E_held, N, K]; built once per layer and reused.

        NOTE: a stopgap until the model holds its experts as views of one stacked tensor. When the
        experts already are such views, the stack is their base (no copy). Otherwise the weights are
        copied once (twice the expert memory); the cache key includes the version counters of the
        first and last held expert, so an in-place reload of those rebuilds it.
        """
        held = [i for i, e in enumerate(experts) if e is not None]
        first, last = experts[held[0]], experts[held[-1]]
        key = tuple((w.data_ptr(), w._version) for e in (first, last) for w in (e.w1, e.w3, e.w2)) + (len(held),)
        stack = self._expert_stacks.get(key)
        if stack is None:
            local_ids = torch.full((len(experts),), len(held), dtype=torch.long, device=device)
            local_ids[held] = torch.arange(len(held), device=device)
            mlps = [experts[i] for i in held]
            stack = self._stacked_experts(
                _stacked([m.w1 for m in mlps]), _stacked([m.w3 for m in mlps]), _stacked([m.w2 for m in mlps]),
                _stacked([m.w1_scale for m in mlps]), _stacked([m.w3_scale for m in mlps]),
                _stacked([m.w2_scale for m in mlps]), first.block, local_ids,
            )
            self._expert_stacks[key] = stack
        return stack


def _stacked(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """torch.stack, or a zero-copy view when the tensors already are consecutive slices of one stack
    (equal shapes, evenly spaced in one storage), as when the model holds its experts stacked."""
    first = tensors[0]
    if first is None:
        return None
    size = first.element_size()
    step = tensors[1].data_ptr() - first.data_ptr() if len(tensors) > 1 else first.numel() * size
    storage = first.untyped_storage().data_ptr()
    if (
        first.is_contiguous() and step >= first.numel() * size and step % size == 0
        and all(
            t.shape == first.shape and t.is_contiguous() and t.untyped_storage().data_ptr() == storage
            and t.data_ptr() == first.data_ptr() + i * step
            for i, t in enumerate(tensors)
        )
    ):
        return first.as_strided((len(tensors), *first.shape), (step // size, *first.stride()))
    return torch.stack(tensors)
