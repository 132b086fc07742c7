"""DeepSeek-V4.1's Engram injection (`KernelOps.engram_gate`) in one launch: a program per (token, stream) row
reduces the row's three sums (X*weight*key, X^2, key^2) in float32, forms the gate and writes X + gate*value
in the streams' dtype. The reference's torch composition launches about 20 kernels for it at a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["engram_gate"]


@triton.jit
def _engram_gate_kernel(
    s_ptr, key_ptr, value_ptr, qw_ptr, kw_ptr, out_ptr, D, eps, scale, stride_st, stride_kt, stride_vt,
    N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(s_ptr + t * stride_st + j * D + cols, mask=ok, other=0.0).to(tl.float32)
    k = tl.load(key_ptr + t * stride_kt + j * D + cols, mask=ok, other=0.0).to(tl.float32)
    # the product of the two weights here, as the reference forms it: no float32 copies a step
    w = (tl.load(qw_ptr + j * D + cols, mask=ok, other=0.0).to(tl.float32)
         * tl.load(kw_ptr + j * D + cols, mask=ok, other=0.0).to(tl.float32))
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * tl.rsqrt(tl.sum(k * k, axis=0) / D + eps)
    dot = tl.sum(x * w * k, axis=0) * rstd * scale
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = tl.sigmoid(tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root))  # copysign: -0.0 too
    v = tl.load(value_ptr + t * stride_vt + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * N + j) * D + cols, (x + gate * v).to(out_ptr.dtype.element_ty), mask=ok)


def engram_gate(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`KernelOps.engram_gate`: streams, key [T, n, D] (key may be a row-strided view of a wider projection);
    value [T, D] (likewise); q_weight, k_weight [n, D] -> [T, n, D] in streams.dtype."""
    t, n, d = streams.shape
    streams = streams.contiguous()
    key = key if key.stride(2) == 1 and key.stride(1) == d else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    out = torch.empty_like(streams)
    if t:
        block = triton.next_power_of_2(d)
        _engram_gate_kernel[(t, n)](
            streams, key, value, q_weight.contiguous(), k_weight.contiguous(), out, d, eps, d ** -0.5, streams.stride(0), key.stride(0),
            value.stride(0), N=n, BLOCK_D=block, num_warps=8 if block >= 2048 else 4, **launch_options(streams.device),
        )
    return out
