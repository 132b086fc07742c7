"""MoE routing after the logits GEMM: one program per token scores its E logits, picks its k experts
(hash table or top-k of scores + bias) and normalises their weights, in one launch.

The GEMM stays with the caller (the reference's own matmul), so the logits are bit-identical to the
reference's; the kernel reads them in their dtype and computes in float32. A token's result depends
on its own logits only, so it is batch-invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["SCORE_FUNCTIONS", "route_logits", "routing_supported"]

SCORE_FUNCTIONS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
# One program holds a token's logits in registers.
_MAX_EXPERTS = 4096


@triton.jit
def _log1p_unit(v):
    """log(1 + v) for v in [0, 1]: 2 atanh(s), s = v / (2 + v) <= 1/3, as its odd series to s^19
    (truncation < 1e-10 relative); no log of a number near 1, so no cancellation."""
    s = v / (2.0 + v)
    t = s * s
    p = 1.0 / 19.0
    p = p * t + 1.0 / 17.0
    p = p * t + 1.0 / 15.0
    p = p * t + 1.0 / 13.0
    p = p * t + 1.0 / 11.0
    p = p * t + 1.0 / 9.0
    p = p * t + 1.0 / 7.0
    p = p * t + 1.0 / 5.0
    p = p * t + 1.0 / 3.0
    p = p * t + 1.0
    return 2.0 * s * p


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr,
    E, TOP_K, stride_l, stride_table, temp, scaling,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    in_e = lanes < E
    x = tl.load(logits_ptr + token * stride_l + lanes, mask=in_e, other=0.0).to(tl.float32)
    x = tl.math.div_rn(x, temp)  # IEEE division, as the reference's logits / gate_temp
    if SCORE == 0:
        # torch's softplus (threshold 20): x above it, else log1p(exp(x)) = max(x, 0) + log1p(exp(-|x|))
        soft = tl.maximum(x, 0.0) + _log1p_unit(tl.exp(-tl.abs(x)))
        scores = tl.sqrt_rn(tl.where(x > 20.0, x, soft))
    elif SCORE == 1:
        scores = tl.sigmoid(x)
    else:
        shifted = tl.exp(tl.where(in_e, x, float("-inf")) - tl.max(tl.where(in_e, x, float("-inf")), 0))
        scores = shifted / tl.sum(shifted, 0)
    slots = tl.arange(0, BLOCK_K)
    in_k = slots < TOP_K
    if HASHED:
        tid = tl.load(input_ids_ptr + token)
        ids = tl.load(tid2eid_ptr + tid * stride_table + slots, mask=in_k, other=0).to(tl.int64)
    else:
        keys = scores
        if HAS_BIAS:
            keys = keys + tl.load(bias_ptr + lanes, mask=in_e, other=0.0).to(tl.float32)
        keys = tl.where(in_e, keys, float("-inf"))
        # One reduction a slot: the key's bits made order-preserving as an int32 (negative floats' magnitude
        # bits flipped), above the complement of the lane, so that the int64 maximum is the best key and,
        # among ties, the lowest expert. (A maximum, a minimum over its ties and a masked sum for the score
        # were three reductions a slot, each a barrier across the program's warps.)
        bits = keys.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        packed = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - lanes).to(tl.int64)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for slot in range(TOP_K):
            choice = BLOCK_E - 1 - (tl.max(packed, 0) & 0xFFFFFFFF)
            ids = tl.where(slots == slot, choice, ids)
            packed = tl.where(lanes == choice, -9223372036854775807 - 1, packed)
    # each slot's score, by a masked sum (registers cannot be indexed); 0 in the slots past k
    picked = tl.sum(tl.where((lanes[None, :] == ids[:, None]) & in_k[:, None], scores[None, :], 0.0), 1)
    if NORMALIZE:
        picked = tl.math.div_rn(picked, tl.sum(picked, 0) + 1e-20)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, picked * scaling, mask=in_k)
    tl.store(ids_ptr + out, ids, mask=in_k)


def routing_supported(num_experts: int, top_k: int) -> bool:
    """A token's logits fit one program, and there are k experts to pick."""
    return num_experts <= _MAX_EXPERTS and 1 <= top_k <= num_experts


def route_logits(
    logits: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    scoring_func: str,
    bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    gate_temp: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) from router logits [T, E] (any float dtype).

    scores = f(logits / gate_temp), f = sqrt(softplus) ("sqrtsoftplus"), sigmoid or softmax (any other
    name, as the reference). ids = tid2eid[input_ids] when the hash table [V, k] is given, else the top-k of
    scores + bias in descending order (lowest expert first on ties). weights = scores[ids], divided by
    their sum + 1e-20 when `normalize`, times routed_scaling_factor.
    """
    tokens, experts = logits.shape
    top_k = top_k if tid2eid is None else tid2eid.shape[1]  # the table's width, as the reference
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    hashed = tid2eid is not None
    if hashed:
        table, token_ids = tid2eid.contiguous(), input_ids.contiguous()
    else:  # unread placeholders
        table = token_ids = logits
    _route_kernel[(tokens,)](
        logits, bias if bias is not None else logits, table, token_ids, weights, ids,
        experts, top_k, logits.stride(0), table.stride(0), float(gate_temp), float(routed_scaling_factor),
        SCORE=SCORE_FUNCTIONS.get(scoring_func, SCORE_FUNCTIONS["softmax"]), HAS_BIAS=bias is not None,
        HASHED=hashed, NORMALIZE=normalize,
        BLOCK_E=max(16, triton.next_power_of_2(experts)), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        **launch_options(logits.device),
    )
    return weights, ids
