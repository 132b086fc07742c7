"""`AscendOps`: the reference `KernelOps` with the ops that torch_npu has a documented fused operator for.

Each override cites the torch_npu page that documents its operator and keeps the reference for the
inputs outside that page's constraints (named at each fallback): there the reference *is* the
contract, so falling back is correct, never a hidden failure. An operator error on supported inputs
propagates. Every other op is the reference in plain torch on the NPU (the report in the README
says which and why).

NOTE: written from the documentation only; no line of it has run on Ascend hardware. The fake
torch_npu in tests/test_ascend_backend.py checks argument plumbing, not numerics:
`scripts/check_ascend.py` is the proof to run on an NPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer_core.platform.expert_stacks import ExpertStacks
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights

__all__ = ["AscendOps"]

# Dtypes npu_rms_norm, npu_rotary_mul and npu_grouped_matmul document for their float inputs.
_NPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# npu_rotary_mul's documented limits (interleave mode): D < 896 and even; B * N < 1000.
_ROTARY_MAX_DIM = 896
_ROTARY_MAX_BATCH_HEADS = 1000


class AscendOps(KernelOps):
    def __init__(self, torch_npu: ModuleType) -> None:
        self._rms_norm = torch_npu.npu_rms_norm
        self._rotary_mul = torch_npu.npu_rotary_mul
        self._grouped_matmul = torch_npu.npu_grouped_matmul
        self._expert_stacks: ExpertStacks[_StackedExperts] = ExpertStacks()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        # torch_npu.npu_rms_norm(self, gamma, epsilon) -> (y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma,
        # self 2-8 dims, gamma of self's dtype. https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000860.html
        # Fallback: dtypes and ranks the operator does not take.
        if x.dtype not in _NPU_FLOATS or not 2 <= x.dim() <= 8:
            return super().rms_norm(x, weight, eps)
        if weight is None:
            gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        else:
            gamma = weight
        # The contract multiplies by the float32 weight in float32: with a float32 weight the
        # operator runs on float32 x, so gamma is never rounded to x.dtype.
        work = x if gamma.dtype == x.dtype else x.float()
        return self._rms_norm(work, gamma.to(work.dtype), epsilon=eps)[0].to(x.dtype)

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        # `inplace` is a permission, not used here: the result is always a new tensor.
        # torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode="interleave"): out = r1 * x + r2 * x_new with
        # x_new[2i] = -x[2i+1], x_new[2i+1] = x[2i]; 4-D input in BSND with r1/r2 broadcast as 1S1D.
        # https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000141.html
        rope_dim = 2 * inv_freq.shape[0]
        heads = math.prod(x.shape[1:-1])
        # Fallback: dtypes, rotary widths and head counts outside the documented limits.
        if x.dtype not in _NPU_FLOATS or rope_dim >= _ROTARY_MAX_DIM or heads >= _ROTARY_MAX_BATCH_HEADS:
            return super().rope(x, positions, inv_freq, inverse)
        angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        cos = angles.cos().to(x.dtype).repeat_interleave(2, dim=-1).view(1, -1, 1, rope_dim)
        sin = angles.sin().to(x.dtype).repeat_interleave(2, dim=-1).view(1, -1, 1, rope_dim)
        if inverse:
            sin = -sin
        rot = x[..., -rope_dim:].reshape(1, x.shape[0], heads, rope_dim).contiguous()
        rotated = self._rotary_mul(rot, cos, sin, rotary_mode="interleave")
        rotated = rotated.view(*x.shape[:-1], rope_dim)
        return torch.cat([x[..., :-rope_dim], rotated], dim=-1)

    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: Sequence[MlpWeights | None],
        shared: MlpWeights | None,
        swiglu_limit: float,
    ) -> torch.Tensor:
        # torch_npu.npu_grouped_matmul([x], [w], group_list=cumsum, split_item=3, group_type=0,
        # group_list_type=0): x and y single 2-D tensors split along M, w one 3-D [E, K, N] tensor,
        # rows group_list[e-1]:group_list[e] of x meet w[e]. float16/bfloat16/float32.
        # https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000524.html
        # The clamped SwiGLU (min(g, L), clamp(u, -L, L)) has no fused operator (npu_swiglu does not
        # clamp), so it runs in torch between the two grouped matmuls.
        held = [e for e, mlp in enumerate(experts) if mlp is not None]
        # Fallback: quantised (fp8 / fp4) experts, which the reference dequantises (see `linear`).
        if not held or x.dtype not in _NPU_FLOATS or not all(_dense(experts[e], x.dtype) for e in held):
            return super().fused_moe(x, weights, ids, experts, shared, swiglu_limit)
        stack = self._expert_stacks.get(experts, functools.partial(_stack, experts))
        top_k = ids.shape[1]
        local = stack.local_ids[ids].flatten()
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=len(held) + 1)[: len(held)]
        group_list = counts.cumsum(0)
        rows = order // top_k
        # Rows routed to experts this rank does not hold sort last, past group_list[-1]: the
        # operator leaves them undefined and `kept` zeroes them.
        kept = (local[order] < len(held)).unsqueeze(-1)
        gate_up = self._grouped(x[rows], stack.w13, group_list)
        gate, up = gate_up.split(stack.inter, dim=-1)
        act = torch.nn.functional.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
        y = self._grouped(act, stack.w2, group_list) * weights.flatten()[order, None]
        routed = torch.zeros_like(x).index_add_(0, rows, torch.where(kept, y, 0.0).to(x.dtype))
        # Expert parallelism passes no shared expert for pairs computed on behalf of another rank.
        return routed if shared is None else routed + self._swiglu(x, shared, swiglu_limit)

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        return self._grouped_matmul(
            [x], [weight], group_list=group_list, split_item=3, group_type=0, group_list_type=0
        )[0]


@dataclass(frozen=True, slots=True)
class _StackedExperts:
    w13: torch.Tensor
    w2: torch.Tensor
    inter: int
    local_ids: torch.Tensor


def _stack(experts: Sequence[MlpWeights | None], held: list[int]) -> _StackedExperts:
    """The held experts as [E_held, D, 2I] (w1 | w3) and [E_held, I, D]: a copy of their weights (the operator
    wants K-major [E, K, N] stacks), built once per layer (`ExpertStacks`)."""
    mlps = [experts[e] for e in held]
    device = mlps[0].w1.device
    local_ids = torch.full((len(experts),), len(held), dtype=torch.long, device=device)
    local_ids[held] = torch.arange(len(held), device=device)
    w13 = torch.stack([torch.cat([m.w1, m.w3]).t() for m in mlps]).contiguous()
    w2 = torch.stack([m.w2.t() for m in mlps]).contiguous()
    return _StackedExperts(w13, w2, mlps[0].w1.shape[0], local_ids)


def _dense(mlp: MlpWeights, dtype: torch.dtype) -> bool:
    return all(w.dtype == dtype for w in (mlp.w1, mlp.w3, mlp.w2))
