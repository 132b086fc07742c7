"""Routed experts as two grouped GEMMs over tokens sorted by expert (bf16, fp8-block or fp4 weights).

Plan (`moe_plan`, three small launches or one for a decode token, no host sync): the T*k (token, slot) pairs
are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so every row block of the
padded order belongs to one expert. Launch 1 computes a = silu(min(w1 x, L)) * clamp(w3 x, -L, L) for each
padded row (both projections in one program, the clamped SwiGLU in the epilogue). Launch 2 computes w2 a,
multiplies the routing weight and writes the pair's row of y [T*k, D]; the k rows of a token are summed in slot order in
float32 (deterministic: no atomic adds of values), by the program whose row of the token arrives last on an arrival
counter (`arrival_counters`) in the same launch, or, with expert parallelism and in steps too large for the
counters, by a third launch. Weights are stacked per projection, w1 / w3 / w2 [E, N, K] (+ scales
[E, ...]), so each expert can stay a separate parameter that views its slice of the stack. The shared
expert is one more pair per token (stack index E_held, its own weight pointers, weight 1): no separate
MLP launches, and x read and quantised once. Stored in fp8 beside fp4 experts (the fp4 checkpoints), its
row blocks take a K loop of their own format in the same launches. With
`fp8_activations`, fp8 experts meet x and the activation quantised to fp8 (`activation_quant`: x once per
token before launch 1, the activation between the launches, or in launch 1's epilogue where a column tile is one
quantisation group: `act_quantized_in_gate_up`), as in `linear`. `prescaled` (DeepSeek-V4.1)
moves the routing weight from w2's output into launch 1's epilogue: it scales the activation before w2.
fp4 experts at decode sizes decode their weights in inline PTX in pair order and put them on the MMA's tall
side, x's few rows on its narrow side (`fp4_kernel_format`, `_tile_dot`). An expert's programs walk its weight's
column tiles a group of its row blocks at a time (`_expert_tile`); 16-bit weights in prefill tiles arrive through
TMA descriptors (`weights_through_tma`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_core.platform.kernel_ops import MlpWeights
from deepinfer_kernels.activation_quant import fp8_activation_tiles_supported, quantize_fp8_rows, quantize_groups
from deepinfer_kernels.arrival_counters import arrival_counters
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.dtype_names import dtype_name, triton_dtype
from deepinfer_kernels.moe_plan import moe_plan
from deepinfer_kernels.weight_tiles import (
    FP4_PAIR_ORDER, FP4_SMALL_SCALES, as_kernel_weight, e8m0_to_float, fp4_scales_small, fp8_tiles, load_weight_tile,
    pair_order, weight_format,
)

__all__ = [
    "StackedExperts", "act_quantized_in_gate_up", "down_columns", "fp4_kernel_format", "gate_up_registers",
    "half_tails", "moe_routed", "moe_supported", "row_group", "shared_fusable", "slot_sum_in_down_launch",
    "step_pairs", "tile_config", "weights_through_tma",
]


@dataclass(frozen=True, slots=True)
class StackedExperts:
    """The held experts' weights stacked on a leading expert dim; `local_ids` [E] maps a global expert
    id to its index in the stack, or to num_held for an expert this rank does not hold."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w3_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    block: tuple[int, int] | None
    local_ids: torch.Tensor
    # fp4 experts whose scales are all at most 2 (`weight_tiles.fp4_scales_small`): one product per weight.
    # Derived once here, as it reads the scales back to the host.
    fp4_small_scales: bool = field(init=False)

    def __post_init__(self) -> None:
        small = weight_format(self.w1) == 2 and fp4_scales_small(self.w1_scale, self.w3_scale, self.w2_scale)
        object.__setattr__(self, "fp4_small_scales", small)

    @property
    def num_held(self) -> int:
        return int(self.w1.shape[0])


@triton.jit
def _gate_up_sums(
    x_ptr, xs_ptr, token, entry, w1, w3, s1, s3, offs_n, pid_n, N, K, stride_xm, stride_xsm, stride_wn, stride_sn,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    w_row=0, TMA: tl.constexpr = False,
):
    """(w1 x, w3 x) [BLOCK_M, BLOCK_N] in float32 for one expert's weights in FORMAT (w_row, TMA: `_weight_tile`)."""
    tl.static_assert(FORMAT == 1 or not A8, "fp8 activations meet fp8 weights of whole-block scales")
    compute = x_ptr.dtype.element_ty  # fp8 codes with A8 (xs_ptr: their per-token, per-K-tile scales)
    WEIGHT_ROWS: tl.constexpr = _weights_on_tall_side(FORMAT, BLOCK_M)
    gate = _dot_zeros(BLOCK_M, BLOCK_N, WEIGHT_ROWS)
    up = _dot_zeros(BLOCK_M, BLOCK_N, WEIGHT_ROWS)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :],
                    mask=(entry[:, None] >= 0) & (offs_k[None, :] < K), other=0.0)
        if FORMAT == 5:  # FP4_PAIR_ORDER weight tiles: x in their column order
            x = pair_order(x)
        g_tile = _weight_tile(w1, w_row, s1, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, compute, BLOCK_K,
                              SCALE_BN, SCALE_BK, TMA)
        u_tile = _weight_tile(w3, w_row, s3, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, compute, BLOCK_K,
                              SCALE_BN, SCALE_BK, TMA)
        if FORMAT == 1:
            # Powers of two: the scales multiply first (exact), then one multiply-add per element, each product
            # promoted as soon as it is made (both products' accumulators live at once spilled past 255 registers)
            scale_at = (pid_n * BLOCK_N // SCALE_BN) * stride_sn + k0 // SCALE_BK
            g_scale = e8m0_to_float(tl.load(s1 + scale_at))
            u_scale = e8m0_to_float(tl.load(s3 + scale_at))
            if A8:  # (fp8 of whole-block scales: never WEIGHT_ROWS)
                x_scale = tl.load(xs_ptr + token * stride_xsm + k0 // BLOCK_K)[:, None]
                g_scale, u_scale = x_scale * g_scale, x_scale * u_scale
            gate += _tile_dot(x, g_tile, IEEE, WEIGHT_ROWS) * g_scale
            up += _tile_dot(x, u_tile, IEEE, WEIGHT_ROWS) * u_scale
        else:
            gate += _tile_dot(x, g_tile, IEEE, WEIGHT_ROWS)
            up += _tile_dot(x, u_tile, IEEE, WEIGHT_ROWS)
    if WEIGHT_ROWS:
        gate, up = tl.trans(gate), tl.trans(up)
    return gate, up


@triton.jit
def _expert_weight(w_ptr, expert, N, stride_we, tile_row, TMA: tl.constexpr):
    """(`expert`'s weight as `_weight_tile` reads it, the row in it of its tile's row tile_row): with TMA the
    stack's descriptor, whose rows run through the experts one after another; else the expert's own pointer."""
    if TMA:
        return w_ptr, expert * N + tile_row
    else:
        return w_ptr + expert.to(tl.int64) * stride_we, tile_row


@triton.jit
def _weight_tile(w, w_row, s, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, COMPUTE: tl.constexpr,
                 BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, TMA: tl.constexpr):
    """`load_weight_tile` (rows offs_n of the pointer w), or with TMA (`weights_through_tma`) the tile at row w_row
    of the descriptor w: the copy engine fills it (zeros past the weight's ends) while the threads only wait."""
    if TMA:
        return w.load([w_row, k0]).to(COMPUTE)
    else:
        return load_weight_tile(w, s, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, COMPUTE, BLOCK_K, SCALE_BN,
                                SCALE_BK)


@triton.jit
def _dot_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHT_ROWS: tl.constexpr):
    if WEIGHT_ROWS:
        zeros = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return zeros


@triton.jit
def _tile_dot(x, w, IEEE: tl.constexpr, WEIGHT_ROWS: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K]^T in float32; WEIGHT_ROWS (`_weights_on_tall_side`:
    the decode-sized fp4 launches, V4.1's 32 x 32 fp8 shared expert's loop included): its
    transpose w x^T [BLOCK_N, BLOCK_M], so that the weights, converted in registers, are the MMA's register
    operand on its tall side and the few rows of x (8) its narrow side. The other way round (x's rows padded
    to 16 on the tall side), every MMA's x fragment was gathered from four shared-memory loads by register
    moves, about one per weight (`ab/sass_moe.py`, sm_90: a K step of gate and up of 32 columns x 128, fp4
    with the PTX decode 820 -> 435 instructions)."""
    a, b = (w, x) if WEIGHT_ROWS else (x, w)
    return tl.dot(a, tl.trans(b), input_precision="ieee" if IEEE else None)


@triton.constexpr_function
def _weights_on_tall_side(FORMAT, BLOCK_M):
    """`_tile_dot`'s WEIGHT_ROWS: x's rows fewer than the MMA's 16, except for fp8 weights of whole-block
    scales (FORMAT 1), measured slower so (H200, `fused_moe` alone: V4's 128 x 128 fp8 shared expert beside
    fp4 experts 463 against 444 us at 16 tokens; V4.1's 32 x 32 one, FORMAT 4, 480 against 509)."""
    return BLOCK_M < 16 and FORMAT != 1


@triton.jit
def _expert_tile(blocks_ptr, N, BLOCK_N: tl.constexpr, ROW_GROUP: tl.constexpr):
    """(expert, row block, column tile) of this program, the expert past the held ones for a block no run holds.

    An expert's programs are those of its run's row blocks (its id range is theirs); they walk its weight's column
    tiles with ROW_GROUP of its row blocks at a time, the row blocks innermost, so the few programs that read one
    weight tile run side by side and it comes from memory once. Row block by row block (all column tiles of a
    block, then the next), an expert's weights stream past once per row block, from memory unless L2 still holds
    them; at 8,192 tokens of 256 experts, top-6 (~190 rows, two blocks an expert) the weights are 190 FLOP a byte
    against the H100's ~240 a byte of bandwidth, as many bytes as the MMAs' time. (Nsight Compute, gate/up launch,
    groups of 8: 9.6 GB from memory for 8.6 GB of weights, 62% of its bandwidth, the SMs' 59%.) A group's rows
    (ROW_GROUP x BLOCK_M x K) stay in L2 while its column tiles pass, as the shared expert's 8,192 rows would not.
    `row_group` gives ROW_GROUP; at 1 this is row block by row block."""
    columns = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    block = pid // columns
    expert = tl.load(blocks_ptr + 3 * block)
    if ROW_GROUP == 1:  # row block by row block
        return expert, block, pid % columns
    first = tl.load(blocks_ptr + 3 * block + 1)
    length = tl.load(blocks_ptr + 3 * block + 2)
    local = pid - first * columns
    group_first = local // (ROW_GROUP * columns) * ROW_GROUP
    size = tl.minimum(length - group_first, ROW_GROUP)
    within = local - group_first * columns
    return expert, first + group_first + within % size, within // size


@triton.jit
def _gate_up_kernel(
    x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, act_ptr, as_ptr, route_w_ptr,
    row_entry_ptr, blocks_ptr, N, K, TOP_K, NUM_ROUTED, limit,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_am, stride_asm,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FORMAT: tl.constexpr, SHARED_SCALE_BN: tl.constexpr, SHARED_SCALE_BK: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, HALF_TAILS: tl.constexpr, PRESCALED: tl.constexpr, ROW_GROUP: tl.constexpr,
    TMA: tl.constexpr, ACT_DTYPE: tl.constexpr, QUANT_ACT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    expert, pid_m, pid_n = _expert_tile(blocks_ptr, N, BLOCK_N, ROW_GROUP)
    if expert >= NUM_ROUTED + SHARED:
        return
    # An expert run's last row block holds its rows first: at half or less, half a tile computes it.
    if HALF_TAILS and tl.load(row_entry_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < 0:
        _gate_up_rows(x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, act_ptr,
                      as_ptr, route_w_ptr, row_entry_ptr, pid_m * BLOCK_M, expert, pid_n, N, K, TOP_K, NUM_ROUTED,
                      limit, stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_swn,
                      stride_ssn, stride_am, stride_asm, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                      IEEE, A8, SHARED, SHARED_FORMAT, SHARED_SCALE_BN, SHARED_SCALE_BK, SHARED_BLOCK_K, PRESCALED,
                      TMA, ACT_DTYPE, QUANT_ACT)
    else:
        _gate_up_rows(x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, act_ptr,
                      as_ptr, route_w_ptr, row_entry_ptr, pid_m * BLOCK_M, expert, pid_n, N, K, TOP_K, NUM_ROUTED,
                      limit, stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_swn,
                      stride_ssn, stride_am, stride_asm, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K,
                      IEEE, A8, SHARED, SHARED_FORMAT, SHARED_SCALE_BN, SHARED_SCALE_BK, SHARED_BLOCK_K, PRESCALED,
                      TMA, ACT_DTYPE, QUANT_ACT)


@triton.jit
def _gate_up_rows(
    x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, act_ptr, as_ptr, route_w_ptr,
    row_entry_ptr, row0, expert, pid_n, N, K, TOP_K, NUM_ROUTED, limit,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_am, stride_asm,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FORMAT: tl.constexpr, SHARED_SCALE_BN: tl.constexpr, SHARED_SCALE_BK: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, PRESCALED: tl.constexpr, TMA: tl.constexpr, ACT_DTYPE: tl.constexpr,
    QUANT_ACT: tl.constexpr,
):
    """act for BLOCK_M rows from row0 of `expert`'s run (launch 1 of `moe_routed`), in x's dtype (ACT_DTYPE), or with
    QUANT_ACT (`act_quantized_in_gate_up`) as its fp8 codes, as_ptr taking their scales; with TMA the weight
    arguments are descriptors of the stacks' rows [E * N, K] (the shared expert's of its [N, K])."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    entry = tl.load(row_entry_ptr + offs_m)
    token = tl.where(entry >= 0, entry // (TOP_K + SHARED), 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_dtype: tl.constexpr = triton_dtype(ACT_DTYPE)
    w1, w_row = _expert_weight(w1_ptr, expert, N, stride_we, pid_n * BLOCK_N, TMA)
    w3, _ = _expert_weight(w3_ptr, expert, N, stride_we, pid_n * BLOCK_N, TMA)  # (the same row as w1's)
    s1 = s1_ptr + expert.to(tl.int64) * stride_se
    s3 = s3_ptr + expert.to(tl.int64) * stride_se
    if SHARED_FORMAT == FORMAT:  # the shared expert's row blocks (if any) read its weights in the same loop
        if SHARED:
            if expert == NUM_ROUTED:
                w1, w3, s1, s3, w_row = sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, pid_n * BLOCK_N
        gate, up = _gate_up_sums(x_ptr, xs_ptr, token, entry, w1, w3, s1, s3, offs_n, pid_n, N, K, stride_xm,
                                 stride_xsm, stride_wn, stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N,
                                 BLOCK_K, IEEE, A8, w_row, TMA)
    elif expert == NUM_ROUTED:  # a shared expert stored unlike the experts (fp8 beside fp4): its own loop
        gate, up = _gate_up_sums(x_ptr, xs_ptr, token, entry, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, offs_n, pid_n, N, K,
                                 stride_xm, stride_xsm, stride_swn, stride_ssn, SHARED_FORMAT, SHARED_SCALE_BN,
                                 SHARED_SCALE_BK, BLOCK_M, BLOCK_N, SHARED_BLOCK_K, IEEE, A8)
    else:
        gate, up = _gate_up_sums(x_ptr, xs_ptr, token, entry, w1, w3, s1, s3, offs_n, pid_n, N, K, stride_xm,
                                 stride_xsm, stride_wn, stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N,
                                 BLOCK_K, IEEE, A8, w_row, TMA)
    # The reference rounds each projection, silu(gate) and the product to the activation dtype (with fp8
    # activations the next launch quantises this very value, so matching its rounding matters). Prescaled,
    # it keeps silu(gate) * up * weight in float32 and rounds once.
    gate = tl.minimum(gate.to(out_dtype).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(out_dtype).to(tl.float32), -limit), limit)
    if PRESCALED:
        act = gate / (1.0 + tl.exp(-gate)) * up * _route_weights(route_w_ptr, entry, TOP_K, SHARED)[:, None]
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32) * up
    act = act.to(out_dtype)
    if QUANT_ACT:  # the tile's columns are one quantisation group of each row (past N they hold zeros)
        codes, scales = quantize_groups(act.to(tl.float32), 1)
        tl.store(as_ptr + offs_m.to(tl.int64) * stride_asm + pid_n, scales)
        act = codes
    tl.store(act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=offs_n[None, :] < N)


@triton.jit
def _route_weights(route_w_ptr, entry, TOP_K, SHARED: tl.constexpr):
    """The routing weight of each padded row's (token, slot) pair: 0 for padding, 1 for the shared expert's
    pair (t, TOP_K); the routed weights are [T, TOP_K]."""
    valid = entry >= 0
    if SHARED:
        slot = entry % (TOP_K + 1)
        return tl.load(route_w_ptr + (entry // (TOP_K + 1)) * TOP_K + slot, mask=valid & (slot < TOP_K), other=1.0)
    return tl.load(route_w_ptr + entry, mask=valid, other=0.0)


@triton.jit
def _down_sums(
    act_ptr, as_ptr, offs_m, w2, s2, offs_n, pid_n, N, K, stride_am, stride_asm, stride_wn, stride_sn,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    w_row=0, TMA: tl.constexpr = False,
):
    """w2 a [BLOCK_M, BLOCK_N] in float32 for one expert's weights in FORMAT (as `_gate_up_sums`)."""
    compute = act_ptr.dtype.element_ty  # fp8 codes with A8 (as_ptr: their per-row, per-K-tile scales)
    WEIGHT_ROWS: tl.constexpr = _weights_on_tall_side(FORMAT, BLOCK_M)
    acc = _dot_zeros(BLOCK_M, BLOCK_N, WEIGHT_ROWS)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=offs_k[None, :] < K, other=0.0)
        if FORMAT == 5:
            a = pair_order(a)
        w = _weight_tile(w2, w_row, s2, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, compute, BLOCK_K, SCALE_BN,
                         SCALE_BK, TMA)
        part = _tile_dot(a, w, IEEE, WEIGHT_ROWS)
        if FORMAT == 1:
            # Powers of two: the scales multiply first (exact), then one multiply-add per element.
            scale = e8m0_to_float(tl.load(s2 + (pid_n * BLOCK_N // SCALE_BN) * stride_sn + k0 // SCALE_BK))
            if A8:
                a_scale = tl.load(as_ptr + offs_m.to(tl.int64) * stride_asm + k0 // BLOCK_K)
                acc += part * (a_scale * scale)[:, None]
            else:
                acc += part * scale
        else:
            acc += part
    if WEIGHT_ROWS:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _down_kernel(
    act_ptr, as_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, y_ptr, total_ptr, counter_ptr, route_w_ptr, row_entry_ptr,
    blocks_ptr, N, K, TOP_K, NUM_ROUTED,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ym,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FORMAT: tl.constexpr, SHARED_SCALE_BN: tl.constexpr, SHARED_SCALE_BK: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, HALF_TAILS: tl.constexpr, PRESCALED: tl.constexpr, SUM_SLOTS: tl.constexpr,
    ROW_GROUP: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    expert, pid_m, pid_n = _expert_tile(blocks_ptr, N, BLOCK_N, ROW_GROUP)
    if expert >= NUM_ROUTED + SHARED:
        return
    if HALF_TAILS and tl.load(row_entry_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < 0:  # as in `_gate_up_kernel`
        _down_rows(act_ptr, as_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, y_ptr, total_ptr, counter_ptr, route_w_ptr,
                   row_entry_ptr, pid_m * BLOCK_M, expert, pid_n, N, K, TOP_K, NUM_ROUTED, stride_am, stride_asm,
                   stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ym, FORMAT, SCALE_BN,
                   SCALE_BK, BLOCK_M // 2, BLOCK_N, BLOCK_K, IEEE, A8, SHARED, SHARED_FORMAT, SHARED_SCALE_BN,
                   SHARED_SCALE_BK, SHARED_BLOCK_K, PRESCALED, SUM_SLOTS, TMA)
    else:
        _down_rows(act_ptr, as_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, y_ptr, total_ptr, counter_ptr, route_w_ptr,
                   row_entry_ptr, pid_m * BLOCK_M, expert, pid_n, N, K, TOP_K, NUM_ROUTED, stride_am, stride_asm,
                   stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ym, FORMAT, SCALE_BN,
                   SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, A8, SHARED, SHARED_FORMAT, SHARED_SCALE_BN,
                   SHARED_SCALE_BK, SHARED_BLOCK_K, PRESCALED, SUM_SLOTS, TMA)


@triton.jit
def _down_rows(
    act_ptr, as_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, y_ptr, total_ptr, counter_ptr, route_w_ptr, row_entry_ptr, row0,
    expert, pid_n, N, K, TOP_K, NUM_ROUTED,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ym,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FORMAT: tl.constexpr, SHARED_SCALE_BN: tl.constexpr, SHARED_SCALE_BK: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, PRESCALED: tl.constexpr, SUM_SLOTS: tl.constexpr, TMA: tl.constexpr,
):
    """y for BLOCK_M rows from row0 of `expert`'s run (launch 2 of `moe_routed`). SUM_SLOTS (`slot_sum_in_down_launch`:
    the slots of a token, or 0): each row then arrives on its token's counter for this column tile, and the program
    whose row arrives last sums the token's SUM_SLOTS rows into total."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    entry = tl.load(row_entry_ptr + offs_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w2, w_row = _expert_weight(w2_ptr, expert, N, stride_we, pid_n * BLOCK_N, TMA)
    s2 = s2_ptr + expert.to(tl.int64) * stride_se
    if SHARED_FORMAT == FORMAT:
        if SHARED:
            if expert == NUM_ROUTED:
                w2, s2, w_row = sw2_ptr, ss2_ptr, pid_n * BLOCK_N
        acc = _down_sums(act_ptr, as_ptr, offs_m, w2, s2, offs_n, pid_n, N, K, stride_am, stride_asm, stride_wn,
                         stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, A8, w_row, TMA)
    elif expert == NUM_ROUTED:  # the shared expert stored unlike the experts: its own loop
        acc = _down_sums(act_ptr, as_ptr, offs_m, sw2_ptr, ss2_ptr, offs_n, pid_n, N, K, stride_am, stride_asm,
                         stride_swn, stride_ssn, SHARED_FORMAT, SHARED_SCALE_BN, SHARED_SCALE_BK, BLOCK_M, BLOCK_N,
                         SHARED_BLOCK_K, IEEE, A8)
    else:
        acc = _down_sums(act_ptr, as_ptr, offs_m, w2, s2, offs_n, pid_n, N, K, stride_am, stride_asm, stride_wn,
                         stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, A8, w_row, TMA)
    valid = entry >= 0
    y = acc.to(y_ptr.dtype.element_ty)
    if not PRESCALED:
        y = y.to(tl.float32) * _route_weights(route_w_ptr, entry, TOP_K, SHARED)[:, None]
    tl.store(y_ptr + tl.where(valid, entry, 0).to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))
    if SUM_SLOTS:
        tl.debug_barrier()  # every thread's rows are written before the release below
        token = tl.where(valid, entry // SUM_SLOTS, 0)
        counters = counter_ptr + token * tl.cdiv(N, BLOCK_N) + pid_n
        last = valid & (tl.atomic_add(counters, 1, mask=valid, sem="acq_rel", scope="gpu") == SUM_SLOTS - 1)
        # from L2 (.cg): this SM's L1 never holds the rows other SMs stored
        _sum_slots(y_ptr, total_ptr, token.to(tl.int64)[:, None], offs_n[None, :],
                   last[:, None] & (offs_n[None, :] < N), N, SUM_SLOTS, ".cg")
        tl.store(counters, 0, mask=last)


# Columns per program of the slot sum: 1,024 bf16 are 16 bytes per thread and load at 4 warps.
_SUM_COLUMNS = 1024
# Arrival counters of the slot sums in the down launch, one per (token, column tile), 128 KiB a device: 256 tokens of
# V4-Flash's hidden 4,096 in the fp4 decode tiles' 32 columns (204 of V4.1's 5,120), twice as many in 64-column
# tiles; never the prefill tiles at those sizes (8,192 pairs: 1,171 tokens at top-6 with the shared expert). Summed
# in the down launch, prefill steps were slower (H100, V4 widths, a million counters, same bits): 8,192 tokens bf16
# 7.0-7.7 -> 7.8-7.9 ms, W8A8 5.42 -> 5.78; the 4-layer step 51.1 -> 54.0 ms (BENCHMARKS.md).
_SLOT_SUM_COUNTERS = 32768


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, D, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """`_sum_slots` a program per token and BLOCK_D columns, after the down launch (`slot_sum_in_down_launch`).
    0.84 of the copy bandwidth at 8,192 tokens, torch's sum over the slot dim 0.50 (BENCHMARKS.md)."""
    wait_for_previous_grid(PDL)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    _sum_slots(y_ptr, out_ptr, tl.program_id(0).to(tl.int64), cols, cols < D, D, SLOTS, "")


@triton.jit
def _sum_slots(y_ptr, out_ptr, token, cols, mask, D, SLOTS: tl.constexpr, CACHE: tl.constexpr):
    """out[token, cols] = y[token, 0] + y[token, 1] + ... over the token's SLOTS rows of y (row token * SLOTS +
    slot) in float32, in slot order (the shared expert last), rounded once to out's dtype: a token's sum never
    depends on the batch, nor on which program sums it. y and out are contiguous rows of D; token and cols
    broadcast against each other; CACHE: the loads' cache modifier."""
    first = token * SLOTS
    total = tl.load(y_ptr + first * D + cols, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    for slot in tl.static_range(1, SLOTS):
        total += tl.load(y_ptr + (first + slot) * D + cols, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    tl.store(out_ptr + token * D + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


# Steps of this many (token, expert) pairs or more take the prefill tiles.
_PREFILL_PAIRS = 8192
# fp4 experts take 8-row tiles of 32 columns below this many pairs, 16 x 64 from it to _PREFILL_PAIRS: at 10-20 rows
# an expert the narrow tiles decode each weight twice or more. H100, the op with the shared expert in its launches,
# 640 / 1,024 tokens: V4.1 5.16 / 7.35 -> 4.36 / 5.56 ms, V4 3.40 / 5.00 -> 2.55 / 3.80 (BENCHMARKS.md).
_FP4_NARROW_PAIRS = 4096


def tile_config(pairs: int, fmt: int, batch_invariant: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of both launches for `pairs` (token, expert) pairs.

    From `scripts/tune_moe_tiles.py` and A/Bs on an H200 (BENCHMARKS.md): tall tiles once experts get
    hundreds of rows each, 16-row tiles while most experts get a few. fp4 experts at decode sizes take 8
    rows of x (the MMA's narrow side, `fp4_kernel_format`), 32 weight rows and 256 columns on 2 warps: with
    the fp8 shared expert fused, 76 / 459 / 1,105 us at 1 / 16 / 64 tokens, against 84.5 / 665 / 1,598 for
    the 16 x 32 / 16 x 64 tiles of 128 before the PTX decode; at 8,192 tokens 128 x 128 x 64 tiles took
    11.6 ms against 12.4 for 128 x 64 x 64; from `_FP4_NARROW_PAIRS` they take the 16 x 64 tiles (in pair
    order too). Measured and not taken: 64-row tiles from 8,192 pairs, 0.80-0.84x the op's time alone at 1,536-2,048
    tokens (random routing), 1.17-1.20x for V4 at 3,072-4,096, and slower in V4.1's whole steps (H100, 2,048 / 4,096
    tokens: 40.94 / 73.26 -> 42.62 / 78.26 ms). Batch-invariant mode takes one configuration whatever the batch (a
    tile shape can change the MMA instructions, hence the order).
    """
    if batch_invariant:
        return (64, 64, 128, 4, 3) if fmt == 1 else (64, 64, 64, 4, 3)
    if pairs >= _PREFILL_PAIRS:
        return {0: (128, 128, 64, 8, 3), 1: (128, 128, 128, 8, 3), 2: (128, 128, 64, 8, 3)}[fmt]
    if fmt == 2 and pairs < _FP4_NARROW_PAIRS:
        return (8, 32, 256, 2, 3)
    return (16, 64, 128, 4, 3)


def gate_up_registers(kernel_format: int, mixed_shared_format: int | None) -> int | None:
    """The register cap (a thread's) of the gate/up launch, or None for the compiler's choice. fp4 decode tiles
    beside an fp8 shared expert of whole-block scales (V4's fp4 checkpoints; mixed_shared_format: the shared
    expert's own loop format, None when it has none) take 128 of their 164: 8 two-warp programs a multiprocessor
    instead of 6, for 4 spill instructions in the fp4 K loop's 862 (sm_90, `scripts/compile_kernels.py`). H200,
    the 4-layer fp4 decode step: 1.066 / 2.048 / 3.933 / 9.767 -> 1.062 / 2.036 / 3.851 / 9.544 ms at batch
    1 / 16 / 64 / 256. Measured slower: V4.1's 32 x 32 shared loop (236 registers) at 128 (66 -> 89 us at one
    token), the down launch (107) at 96 (BENCHMARKS.md).
    """
    return 128 if kernel_format == FP4_PAIR_ORDER and mixed_shared_format == 1 else None


def fp4_kernel_format(block_m: int) -> int:
    """The FORMAT of fp4 experts whose scales are all at most 2 in tiles of block_m rows: decode-sized tiles
    (16 rows or fewer) put the weights on the MMA's tall side in pair order (FP4_PAIR_ORDER); taller ones
    keep x there and decode in float32 (FP4_SMALL_SCALES)."""
    return FP4_PAIR_ORDER if block_m <= 16 else FP4_SMALL_SCALES


def half_tails(block_m: int, batch_invariant: bool) -> bool:
    """Whether a row block that is half padding or more (an expert run's last) runs as half a tile. At
    8,192 tokens of 256 experts, top-6, an expert's run ends in a partial 128-row block, on average half
    empty: a fifth of the MMA rows were padding. Not in batch-invariant mode (a row's tile shape would
    depend on its batch) nor with decode tiles (8 or 16 rows: too few to halve)."""
    return block_m >= 128 and not batch_invariant


def slot_sum_in_down_launch(tokens: int, column_tiles: int, held_all: bool) -> bool:
    """Whether the down launch sums each token's slots itself (`_down_rows`' SUM_SLOTS: the program whose row of
    the token arrives last on its counter for the column tile) instead of `_sum_slots_kernel` after it: a launch
    and its boundary fewer in a latency-bound decode step. Only when every expert is held (with expert parallelism
    the pairs of experts held elsewhere are never stored here: their tokens' counts would never complete, nor their
    counters reset) and the step's tokens * column_tiles counters fit in `_SLOT_SUM_COUNTERS`. Both ways a token's
    sum is the same bits (`_sum_slots` over its stored rows), so batch-invariant mode takes the same rule."""
    return held_all and tokens * column_tiles <= _SLOT_SUM_COUNTERS


def row_group(kernel_format: int, block_m: int) -> int:
    """`_expert_tile`'s ROW_GROUP for row blocks of block_m rows: 8 for 16-bit experts in prefill tiles (H100, V4
    widths, bf16, 8,192 tokens: the op 7.62 -> 7.33 ms against row block by row block, the 4-layer step 55.48 / 55.37
    -> 54.88 / 54.91 ms; 16,384 tokens 12.82 -> 12.47 ms); 1, row block by row block, otherwise: fp8 (W8A8) and fp4
    experts measured the same either way (5.40 / 5.44 and 10.15 / 10.10 ms), and with groups the fp8 gate/up
    launch spilled more on sm_100 (304 -> 472 bytes, `compile_kernels.py`); decode tiles, whose experts hold a block
    or two, measured 0.5-0.8% slower with groups (fp4 decode 1.18 -> 1.19 ms at batch 1, 4.05 -> 4.07 at 64)."""
    return 8 if kernel_format == 0 and block_m >= 64 else 1


def down_columns(kernel_format: int, block_m: int, block_n: int) -> int:
    """The down launch's BLOCK_N, the gate/up launch's being block_n: twice as wide for 16-bit experts in 128-row
    tiles (the gate/up launch's two accumulators of 128 x 128 are one of 128 x 256 in down: 98 -> 175 registers,
    147 KB of shared memory at 3 stages; the same bits). H100, V4 widths, bf16, the down launch at 16,384 tokens
    4.23 / 4.21 -> 3.71 / 3.82 ms, at 8,192 2.30 / 2.33 -> 2.28 / 2.31; the 4-layer step at 8,192 tokens 54.05 /
    53.74 -> 53.56 / 53.35 ms (BENCHMARKS.md)."""
    return 2 * block_n if kernel_format == 0 and block_m == 128 else block_n


def act_quantized_in_gate_up(a8: bool, block_n: int, block_k: int) -> bool:
    """Whether the gate/up launch stores the activation as fp8 codes and scales (W8A8: `a8`), in place of
    x's dtype for a quantisation launch to read back: when each of its column tiles is exactly one
    quantisation group of w2's K (block_n == block_k, the prefill tiles of 128 x 128 blocks). The same codes
    as that launch's (the interpreter's tests compare them bitwise)."""
    return a8 and block_n == block_k


def weights_through_tma(kernel_format: int, block_m: int, ieee: bool) -> bool:
    """Whether both launches read the weights through TMA descriptors (`_weight_tile`): 16-bit experts (not the
    float32 MMAs of `ieee`) in tiles of 64 rows or more (the prefill tiles, batch-invariant mode's; the same bits
    either way). The weight tiles' address arithmetic and per-thread copies leave the K loop: H100, V4 widths,
    bf16, 8,192 tokens, the op 7.33 -> 7.08-7.13 ms, the 4-layer step 55.04 / 54.99 -> 53.95 / 53.97 ms (gate/up
    launch 244 -> 210 registers, down 123 -> 98). fp8 experts' gate/up launch spilled so (255 registers, 128 bytes
    in its K loop) and took 1.45x as long (W8A8, BENCHMARKS.md); fp4 weights are decoded in registers."""
    return kernel_format == 0 and block_m >= 64 and not ieee


def _weight_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's rows as one [rows, K] matrix for a TMA descriptor (a stack [E, N, K] of experts packed one after
    another, or one expert's [N, K]: the descriptor's row of expert e's row n is e * N + n), or None when its layout
    has none (gaps between experts, unaligned rows)."""
    packed = weight.stride(-1) == 1 and (weight.dim() == 2 or weight.stride(0) == weight.shape[1] * weight.stride(1))
    if not packed or weight.data_ptr() % 16 or weight.stride(-2) * weight.element_size() % 16:
        return None
    return weight.reshape(-1, weight.shape[-1])


def _tma_descriptors(weights: tuple[torch.Tensor, ...], rows: list[int], block_k: int) -> list | None:
    """TMA descriptors of the weights in tiles of rows[i] x block_k, or None when a weight's layout has none
    (`_weight_rows`: the launches then take the pointers). A weight given twice in the same tiles (the experts' own
    in the shared expert's place when none is fused) gets one descriptor."""
    weights_2d = [_weight_rows(w) for w in weights]
    if any(w is None for w in weights_2d):
        return None
    made, descriptors = {}, []
    for w, n in zip(weights_2d, rows):
        key = (w.data_ptr(), w.shape, n)
        if key not in made:
            made[key] = TensorDescriptor.from_tensor(w, [n, block_k])
        descriptors.append(made[key])
    return descriptors


def moe_supported(experts: StackedExperts, fp8_activations: bool) -> bool:
    """fp8 experts under fp8 activations need K tiles equal to their weight block's K."""
    return not (fp8_activations and weight_format(experts.w1) == 1) or fp8_activation_tiles_supported(experts.block)


def shared_fusable(
    experts: StackedExperts, shared: MlpWeights, fp8_activations: bool = False, pairs: int | None = 1,
) -> bool:
    """The shared expert can run in the routed launches of a step of `pairs` (token, expert) pairs, its own
    counted. Either each of its tensors has an expert's dtype, shape and strides, or it is fp8 block-scaled
    beside fp4 experts (as the fp4 checkpoints store it) with the experts' shapes and a power-of-two block
    of at least 32: it then takes a K loop of its own in the same launches, in decode-sized steps only (the
    second loop costs the prefill tiles occupancy. H200, fused against apart: 103 / 696 / 1,747 us against
    114 / 775 / 1,903 at 1 / 16 / 64 tokens, 15.2 ms against 12.8 at 8,192; BENCHMARKS.md), and not with
    fp8 activations (they would quantise its input and not the experts').
    pairs=None asks for one answer for every step size (batch-invariant mode: its K tiles differ from
    `linear`'s, so a token's result must not depend on which side of the size threshold its batch falls):
    such a shared expert then always runs apart."""
    if _same_layout(experts, shared):
        return True
    mixed = weight_format(experts.w1) == 2 and weight_format(shared.w1) == 1 and shared.block is not None
    if not mixed or fp8_activations or pairs is None or pairs >= _PREFILL_PAIRS:
        return False
    unpacked = [(shared.w1, experts.w1), (shared.w3, experts.w3), (shared.w2, experts.w2)]
    shapes_match = all(one.shape == (stack.shape[1], 2 * stack.shape[2]) for one, stack in unpacked)
    return shapes_match and all(b >= 32 and b & (b - 1) == 0 for b in shared.block)


def step_pairs(ids: torch.Tensor, batch_invariant: bool) -> int | None:
    """`shared_fusable`'s pairs for a step routed to ids [T, k]: its (token, expert) pairs with the shared
    expert's, or None in batch-invariant mode (one answer for every step size)."""
    return None if batch_invariant else ids.numel() + ids.shape[0]


def _same_layout(experts: StackedExperts, shared: MlpWeights) -> bool:
    pairs = [(shared.w1, experts.w1), (shared.w3, experts.w3), (shared.w2, experts.w2),
             (shared.w1_scale, experts.w1_scale), (shared.w3_scale, experts.w3_scale),
             (shared.w2_scale, experts.w2_scale)]
    for one, stack in pairs:
        if (one is None) != (stack is None):
            return False
        if one is not None and (one.dtype != stack.dtype or one.shape != stack.shape[1:] or one.stride() != stack.stride()[1:]):
            return False
    return shared.block == experts.block


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if scale is None:
        return weight, 0, 0
    s = scale.view(torch.uint8)
    return s, s.stride(0), s.stride(1)


def moe_routed(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: StackedExperts, swiglu_limit: float,
    batch_invariant: bool = False, fp8_activations: bool = False, shared: MlpWeights | None = None,
    out_dtype: torch.dtype = torch.float32, prescaled: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * mlp_{ids[t, k]}(x[t]) (+ mlp_shared(x[t]), added last), summed in float32 and
    stored as out_dtype [T, D] (x's dtype when nothing is added to it after: one rounding, no conversion
    launch); experts not held add nothing.

    shared: the shared expert (see `shared_fusable`), run in the same two launches as one more pair of
    weight 1 per token, so its output meets the same roundings as the reference's separate MLP.
    batch_invariant: one row-block size for every batch (the outputs are always summed in slot order).
    fp8_activations: fp8 experts meet their inputs quantised to fp8 (W8A8; see `moe_supported`).
    prescaled: the weight scales the activation (silu(w1 x) * (w3 x) * weight, rounded once) before w2, as
    `KernelOps.fused_moe_prescaled` (DeepSeek-V4.1), instead of w2's output.
    """
    tokens, top_k = ids.shape
    hidden, inter = x.shape[1], experts.w1.shape[1]
    fmt = weight_format(experts.w1)
    if shared is not None and not shared_fusable(experts, shared, fp8_activations, step_pairs(ids, batch_invariant)):
        raise ValueError("the shared expert's weights differ in dtype, shape, strides or block from the experts'")
    if not moe_supported(experts, fp8_activations):
        raise ValueError(f"fp8 activations need an fp8 weight block of 32, 64 or 128 columns, not {experts.block}")
    fused = shared is not None
    slots = top_k + fused
    shared_fmt = weight_format(shared.w1) if fused else fmt
    # A fused fp4 shared expert's scales are not checked (the released fp4 checkpoints keep it in fp8); with no
    # shared expert in the launches (prefill sizes, batch-invariant mode, expert parallelism) the experts' decide.
    small = fmt == 2 and experts.fp4_small_scales and not (fused and shared_fmt == 2)
    block_m, block_n, block_k, warps, stages = tile_config(tokens * slots, fmt, batch_invariant)
    kernel_format = fp4_kernel_format(block_m) if small else fmt
    a8 = fp8_activations and fmt == 1
    if fmt == 1:  # tiles inside one scale block; with fp8 activations a K tile is exactly one block
        block_n = min(block_n, experts.block[0])
        block_k = experts.block[1] if a8 else min(block_k, experts.block[1])
    scale_bn, scale_bk = experts.block if fmt == 1 else (1, 1)
    mixed = shared_fmt != fmt  # an fp8 shared expert beside fp4 experts: its own K loop
    shared_format, shared_block_k = kernel_format, block_k
    if mixed:  # in tiles inside one of its scale blocks, or (V4.1's 32 x 32) of whole blocks scaled in the tile
        shared_format, block_n, shared_block_k = fp8_tiles(shared.block, block_n, block_k)
    shared_args = dict(
        SHARED=fused, SHARED_FORMAT=shared_format,
        SHARED_SCALE_BN=shared.block[0] if mixed else scale_bn, SHARED_SCALE_BK=shared.block[1] if mixed else scale_bk,
        SHARED_BLOCK_K=shared_block_k,
        HALF_TAILS=half_tails(block_m, batch_invariant), PRESCALED=prescaled,
        ROW_GROUP=row_group(kernel_format, block_m),
    )
    row_entry, blocks = moe_plan(ids, experts.local_ids, experts.num_held, block_m, fused)
    x = x.contiguous()
    # fp8 codes meet on fp8 MMAs whatever x.dtype; in tiles of 64+ rows (wgmma) Hopper adds their products below
    # float32 precision, so float32 W8A8 is not the float32 reference's there (op_cases' fp8_experts_fp8_activations)
    ieee = x.dtype == torch.float32 and not a8
    w1, _ = as_kernel_weight(experts.w1, None)
    w3, _ = as_kernel_weight(experts.w3, None)
    w2, _ = as_kernel_weight(experts.w2, None)
    s1, se, sn = _scale_args(experts.w1_scale, w1)
    s3, _, _ = _scale_args(experts.w3_scale, w3)
    s2, se2, sn2 = _scale_args(experts.w2_scale, w2)
    # the shared expert's weights and scales (the stack's again when there is none: never read)
    source = shared if fused else experts
    sw1, sw3, sw2 = (as_kernel_weight(w, None)[0] for w in (source.w1, source.w3, source.w2))
    ss1, ss3, ss2 = (_scale_args(sc, w)[0] for sc, w in zip((source.w1_scale, source.w3_scale, source.w2_scale), (sw1, sw3, sw2)))
    # row strides of the shared expert's weights and scales (an expert's when it is stored like one)
    if mixed:
        shared_strides = [(sw1.stride(0), ss1.stride(0)), (sw2.stride(0), ss2.stride(0))]
    else:
        shared_strides = [(w1.stride(1), sn), (w2.stride(1), sn2)]
    down_n = down_columns(kernel_format, block_m, block_n)
    pointers = (w1, w3, sw1, sw3, w2, sw2)
    descriptors = (_tma_descriptors(pointers, [block_n] * 4 + [down_n] * 2, block_k)
                   if weights_through_tma(kernel_format, block_m, ieee) else None)
    tma = descriptors is not None
    w1_arg, w3_arg, sw1_arg, sw3_arg, w2_arg, sw2_arg = descriptors or pointers
    quant_act = act_quantized_in_gate_up(a8, block_n, block_k)
    act = torch.empty((row_entry.shape[0], inter), dtype=torch.float8_e4m3fn if quant_act else x.dtype, device=x.device)
    act_scales = (torch.empty((act.shape[0], triton.cdiv(inter, block_k)), dtype=torch.float32, device=x.device)
                  if quant_act else act)
    x_in, x_scales = quantize_fp8_rows(x, block_k) if a8 else (x, x)
    route_w = weights.reshape(-1).float().contiguous()
    _gate_up_kernel[(blocks.shape[0] * triton.cdiv(inter, block_n),)](
        x_in, x_scales, w1_arg, w3_arg, s1, s3, sw1_arg, sw3_arg, ss1, ss3, act, act_scales, route_w, row_entry,
        blocks, inter, hidden, top_k, experts.num_held, swiglu_limit,
        x_in.stride(0), x_scales.stride(0), w1.stride(0), w1.stride(1), se, sn, *shared_strides[0], act.stride(0),
        act_scales.stride(0), FORMAT=kernel_format, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, A8=a8, TMA=tma,
        ACT_DTYPE=dtype_name(x.dtype), QUANT_ACT=quant_act, **shared_args,
        num_warps=warps, num_stages=stages, **launch_options(x.device),
        maxnreg=gate_up_registers(kernel_format, shared_format if mixed else None),
    )
    held_all = bool(experts.num_held == experts.local_ids.shape[0])
    alloc = torch.empty if held_all else torch.zeros
    y = alloc((tokens * slots, hidden), dtype=x.dtype, device=x.device)
    total = torch.empty((tokens, hidden), dtype=out_dtype, device=x.device)
    column_tiles = triton.cdiv(hidden, down_n)
    sum_in_down = slot_sum_in_down_launch(tokens, column_tiles, held_all)
    counters = arrival_counters("MoE slot-sum", x.device, _SLOT_SUM_COUNTERS) if sum_in_down else y  # y: never read
    if a8 and not quant_act:
        act, act_scales = quantize_fp8_rows(act, block_k)
    _down_kernel[(blocks.shape[0] * column_tiles,)](
        act, act_scales, w2_arg, s2, sw2_arg, ss2, y, total, counters, route_w, row_entry, blocks,
        hidden, inter, top_k, experts.num_held,
        act.stride(0), act_scales.stride(0), w2.stride(0), w2.stride(1), se2, sn2, *shared_strides[1], y.stride(0),
        FORMAT=kernel_format, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        BLOCK_M=block_m, BLOCK_N=down_n, BLOCK_K=block_k, IEEE=ieee, A8=a8, TMA=tma, **shared_args,
        SUM_SLOTS=slots if sum_in_down else 0, num_warps=warps, num_stages=stages, **launch_options(x.device),
    )
    if tokens and not sum_in_down:
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, _SUM_COLUMNS))](
            y, total, hidden, SLOTS=slots, BLOCK_D=_SUM_COLUMNS, **launch_options(y.device)
        )
    return total
