"""Shared-KV sparse attention (prefill and decode) over the window ring, this step's kv and the paged
compressed entries, with a per-head sink and a float32 online softmax.

One program per (query token, block of BLOCK_H heads): every key block is loaded once and meets all
BLOCK_H heads on the tensor cores (K = V, so one load serves both products). Keys come in three runs:
the ring positions still in the window that were cached before the step, this step's rows up to the
query, then the compressed entries (all visible ones, or the indexer's selection), read through the
sequence's block table. The sink starts the running max and sum (its probability is dropped).
With FIXED_KEY_BLOCKS (batch-invariant mode) the window keys are one run in blocks aligned to the
query's position, each key read from the ring or from this step's rows: the online softmax then
meets the same key blocks however the sequence was split into chunks.

With ROTARY the kernel also does what the block does around it (`KernelOps.rotary_attention`): it
normalises (Q_NORM) and rotates each query head as it loads it, and de-rotates the output as it stores it,
so q and the output each take no pass of their own.

On Hopper a prefill step (64 heads a program, bf16, head dim 512) runs `sparse_attention_wgmma`'s Gluon
kernel instead, which splits the products between the warp groups and overlaps them with the softmax. Asked for
fp8 codes (`quantize_group`: W8A8's wo_a input), that kernel quantises in its epilogue; the others' output is
quantised by a launch after them.

A decode step has too few (token, head block) programs to fill the GPU, so its keys are split
(flash-decoding): split s takes key blocks s, s + SPLITS, ... of every run and writes its running
max, sum and unnormalised output; a second launch combines a head's splits in one fixed-order reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.activation_quant import quantize_fp8_rows
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.rope import rotate_tile
from deepinfer_kernels.sparse_attention_wgmma import (
    HEADS, quantizes_output, wgmma_attention, wgmma_attention_supported,
)

__all__ = ["key_splits", "sparse_attention", "tile_config"]

MAX_KEY_SPLITS = 16  # a power of two


@triton.jit
def _attend(q, k, valid, m_i, l_i, acc, scale, ROUND: tl.constexpr, IEEE: tl.constexpr):
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if ROUND:
        # The reference forms logits in the query dtype: the product, then the scaled product, are rounded.
        s = (s.to(q.dtype).to(tl.float32) * scale).to(q.dtype).to(tl.float32)
    else:
        s = s * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(k.dtype), k, input_precision="ieee")
    else:
        pv = tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, window_ptr, sinks_ptr, entries_ptr, selected_ptr, out_ptr, part_ptr, stats_ptr,
    token_seq_ptr, query_start_ptr, context_lens_ptr, slot_ids_ptr, block_tables_ptr, positions_ptr, window_starts_ptr,
    freq_ptr, H, D, RING, ratio, per_block, top_k, scale, rope_half, q_eps,
    stride_qt, stride_qh, stride_kv, stride_ws, stride_wp, stride_eb, stride_eo, stride_sel, stride_bt,
    stride_ot, stride_oh,
    HAS_ENTRIES: tl.constexpr, HAS_SELECTED: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr,
    FIXED_KEY_BLOCKS: tl.constexpr, HAS_WINDOW_STARTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, ROTARY: tl.constexpr, Q_NORM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    t = tl.program_id(0)
    split = tl.program_id(2)
    first = split * BLOCK_N  # this split's first key block in every run, then every SPLITS-th
    stride = SPLITS * BLOCK_N
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    seq = tl.load(token_seq_ptr + t)
    start = tl.load(query_start_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int32)
    kv_dtype = kv_ptr.dtype.element_ty
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_mask[None, :], other=0.0)
    if Q_NORM:  # as rms_norm without a weight: float32, rounded to q's dtype
        q32 = q.to(tl.float32)
        q = (q32 * tl.rsqrt(tl.sum(q32 * q32, axis=1) / D + q_eps)[:, None]).to(q.dtype)
    if ROTARY:
        q = rotate_tile(q, pos, freq_ptr, D, rope_half, 1.0, BLOCK_D)
    if Q_NORM or ROTARY:
        # Staged through this program's rows of the output: read back from memory, q feeds the tensor cores
        # from shared memory; computed in registers, Triton would keep it there as the MMA's operand, a copy
        # live through every key block (spills at 64 heads a program). The key splits of one head block
        # stage the same values, so their overlapping stores are harmless.
        q_rows = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(q_rows, q, mask=h_ok[:, None] & d_mask[None, :])
        tl.debug_barrier()
        q = tl.load(q_rows, mask=h_ok[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    l_i = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
    if split > 0:  # the sink counts once, in split 0; a finite floor keeps all-masked blocks NaN-free
        m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    lo = tl.maximum(pos - RING + 1, 0)
    if HAS_WINDOW_STARTS:  # bounded prefix replay: no window KV below the sequence's replay start
        lo = tl.maximum(lo, tl.load(window_starts_ptr + seq))
    if FIXED_KEY_BLOCKS:
        for p0 in range(lo + first, pos + 1, stride):
            p = p0 + tl.arange(0, BLOCK_N)
            cached = p < ctx
            fresh = (p >= ctx) & (p <= pos)
            k_ring = tl.load(window_ptr + slot * stride_ws + (p % RING)[:, None] * stride_wp + offs_d[None, :],
                             mask=cached[:, None] & d_mask[None, :], other=0.0).to(kv_dtype)
            rows = (start + p - ctx).to(tl.int64)
            k_step = tl.load(kv_ptr + rows[:, None] * stride_kv + offs_d[None, :],
                             mask=fresh[:, None] & d_mask[None, :], other=0.0)
            k = tl.where(cached[:, None], k_ring, k_step)
            m_i, l_i, acc = _attend(q, k, cached | fresh, m_i, l_i, acc, scale, ROUND, IEEE)
    else:
        for p0 in range(lo + first, ctx, stride):
            p = p0 + tl.arange(0, BLOCK_N)
            valid = p < ctx
            k = tl.load(window_ptr + slot * stride_ws + (p % RING)[:, None] * stride_wp + offs_d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0).to(kv_dtype)
            m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale, ROUND, IEEE)
        for p0 in range(tl.maximum(lo, ctx) + first, pos + 1, stride):
            p = p0 + tl.arange(0, BLOCK_N)
            valid = p <= pos
            rows = (start + p - ctx).to(tl.int64)
            k = tl.load(kv_ptr + rows[:, None] * stride_kv + offs_d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0)
            m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale, ROUND, IEEE)
    if HAS_ENTRIES:
        visible = (pos + 1) // ratio
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if HAS_SELECTED:
            for j0 in range(first, top_k, stride):
                j = j0 + tl.arange(0, BLOCK_N)
                w = tl.load(selected_ptr + t.to(tl.int64) * stride_sel + j, mask=j < top_k, other=-1).to(tl.int32)
                valid = (w >= 0) & (w < visible)
                block = tl.load(table + w // per_block, mask=valid, other=0).to(tl.int64)
                k = tl.load(entries_ptr + block[:, None] * stride_eb + (w % per_block)[:, None] * stride_eo
                            + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0).to(kv_dtype)
                m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale, ROUND, IEEE)
        else:
            for w0 in range(first, visible, stride):
                w = w0 + tl.arange(0, BLOCK_N)
                valid = w < visible
                block = tl.load(table + w // per_block, mask=valid, other=0).to(tl.int64)
                k = tl.load(entries_ptr + block[:, None] * stride_eb + (w % per_block)[:, None] * stride_eo
                            + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0).to(kv_dtype)
                m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale, ROUND, IEEE)
    if SPLITS == 1:
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        if ROTARY:
            out = rotate_tile(out, pos, freq_ptr, D, rope_half, -1.0, BLOCK_D)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out, mask=h_ok[:, None] & d_mask[None, :])
    else:  # [T, SPLITS, H, BLOCK_D] unnormalised outputs, [T, SPLITS, 2, H] running maxima and sums
        row = (t.to(tl.int64) * SPLITS + split) * H + offs_h
        tl.store(part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=h_ok[:, None])
        stats = stats_ptr + (t.to(tl.int64) * SPLITS + split) * 2 * H + offs_h
        tl.store(stats, m_i, mask=h_ok)
        tl.store(stats + H, l_i, mask=h_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr, stats_ptr, out_ptr, positions_ptr, freq_ptr, H, D, rope_half, stride_ot, stride_oh,
    SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    splits = tl.arange(0, SPLITS)
    stats = stats_ptr + (t * SPLITS + splits) * 2 * H + h
    m = tl.load(stats)
    weight = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(weight * tl.load(stats + H), axis=0)
    rows = (t * SPLITS + splits) * H + h
    acc = tl.sum(weight[:, None] * tl.load(part_ptr + rows[:, None] * BLOCK_D + offs_d[None, :]), axis=0)
    out = (acc / total).to(out_ptr.dtype.element_ty)
    if ROTARY:
        out = tl.reshape(rotate_tile(tl.reshape(out, [1, BLOCK_D]), tl.load(positions_ptr + t), freq_ptr, D,
                                     rope_half, -1.0, BLOCK_D), [BLOCK_D])
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out, mask=offs_d < D)


def tile_config(tokens: int, dim: int, dtype: torch.dtype, batch_invariant: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, warps, stages) for a step of `tokens` queries, from scripts/tune_attention_tiles.py
    on an H200 (BENCHMARKS.md): a prefill loads each key once for all 64 heads of a token (CSA prefill 4.6
    -> 2.8 ms at 4096 tokens); a small decode step keeps 16 heads a program, so it has more programs.
    Batch-invariant mode takes one configuration whatever the step (an MMA shape can change the order)."""
    block_n = 32 if triton.next_power_of_2(dim) <= 256 or dtype != torch.float32 else 16
    if batch_invariant:
        return 16, block_n, 4, 2
    if tokens >= 512 and dtype != torch.float32:
        return 64, 32, 8, 2
    return 16, block_n, 8 if tokens <= 16 else 4, 2


def key_splits(programs: int, num_sms: int | None, batch_invariant: bool) -> int:
    """Key splits for a step of `programs` (token, head block) programs: enough to cover the GPU once,
    a power of two (the combining launch holds all splits of a head in one tile). Not in batch-invariant
    mode (the split changes the softmax's summation order)."""
    if batch_invariant or num_sms is None or programs >= num_sms:
        return 1
    return min(MAX_KEY_SPLITS, triton.next_power_of_2(-(-num_sms // programs)))


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    window: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    batch: ForwardBatch,
    entries: torch.Tensor | None = None,
    ratio: int = 0,
    selected: torch.Tensor | None = None,
    batch_invariant: bool = False,
    num_sms: int | None = None,
    inv_freq: torch.Tensor | None = None,
    q_norm_eps: float | None = None,
    quantize_group: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`KernelOps.sparse_attention` (same contract); `selected` rows must not repeat an entry.
    batch_invariant: window key blocks aligned to each query's position (FIXED_KEY_BLOCKS).
    num_sms: the device's multiprocessors; given, a step with fewer programs splits its keys.
    inv_freq, q_norm_eps: `KernelOps.rotary_attention` instead (q normalised when q_norm_eps is given,
    rotated with inv_freq at batch.positions, the output de-rotated); the head dim must be even.
    quantize_group: the output as fp8 codes [T, H, d] and float32 scales [T, H * d / group] instead, each token's
    row quantised in groups of that many columns (`KernelOps.rotary_attention_quantized`): by the Hopper prefill
    kernel's epilogue where a head holds whole groups, after the other launches (`quantize_fp8_rows`)."""
    tokens, heads, dim = q.shape
    if inv_freq is not None and (dim % 2 or 2 * inv_freq.shape[0] > dim):
        raise ValueError(f"rotary attention needs an even head dim of at least {2 * inv_freq.shape[0]}, not {dim}")
    if quantize_group is not None and heads * dim % quantize_group:
        raise ValueError(f"an attention output of {heads} x {dim} columns a token splits {quantize_group}-column "
                         "groups")
    out = torch.empty_like(q)
    if tokens == 0:
        return out if quantize_group is None else _quantized(out, quantize_group)
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    token_seq = batch.row_sequences()
    has_entries = entries is not None
    window_starts = token_seq if batch.window_starts_cpu is None else torch.tensor(
        batch.window_starts_cpu, dtype=torch.int32).to(q.device, non_blocking=True)
    entries_arg = entries if has_entries else kv
    selected_arg = selected if selected is not None else token_seq
    block_h, block_n, warps, stages = tile_config(tokens, dim, q.dtype, batch_invariant)
    block_d = triton.next_power_of_2(dim)
    head_blocks = triton.cdiv(heads, block_h)
    splits = key_splits(tokens * head_blocks, num_sms, batch_invariant)
    part, stats = out, out  # never read with one split
    if splits > 1:
        part = torch.empty((tokens, splits, heads, block_d), dtype=torch.float32, device=q.device)
        stats = torch.empty((tokens, splits, 2, heads), dtype=torch.float32, device=q.device)
    rotary = inv_freq is not None
    freq = inv_freq.float().contiguous() if rotary else sinks
    rope_half = inv_freq.shape[0] if rotary else 0
    if (block_h == HEADS.value and splits == 1 and not batch_invariant
            and wgmma_attention_supported(q, kv, window, entries, rope_half)):
        if quantizes_output(quantize_group):
            codes = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
            scales = torch.empty((tokens, heads * dim // quantize_group), dtype=torch.float32, device=q.device)
            wgmma_attention(q, kv, window, sinks, scale, batch, codes, token_seq, window_starts, entries, ratio,
                            selected, freq, rope_half, q_norm_eps, scales, quantize_group)
            return codes, scales
        wgmma_attention(q, kv, window, sinks, scale, batch, out, token_seq, window_starts, entries, ratio, selected,
                        freq, rope_half, q_norm_eps)
        return out if quantize_group is None else _quantized(out, quantize_group)
    _sparse_attention_kernel[(tokens, head_blocks, splits)](
        q, kv, window, sinks, entries_arg, selected_arg, out, part, stats,
        token_seq, batch.query_start_loc, batch.context_lens, batch.slot_ids, batch.block_tables, batch.positions,
        window_starts, freq, heads, dim, window.shape[1], max(ratio, 1), entries.shape[1] if has_entries else 1,
        selected.shape[1] if selected is not None else 0, scale, rope_half, q_norm_eps or 0.0,
        q.stride(0), q.stride(1), kv.stride(0), window.stride(0), window.stride(1),
        entries_arg.stride(0), entries_arg.stride(1) if has_entries else 0,
        selected_arg.stride(0), batch.block_tables.stride(0), out.stride(0), out.stride(1),
        HAS_ENTRIES=has_entries, HAS_SELECTED=selected is not None, ROUND=q.dtype != torch.float32,
        IEEE=q.dtype == torch.float32, FIXED_KEY_BLOCKS=batch_invariant,
        HAS_WINDOW_STARTS=batch.window_starts_cpu is not None, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_D=block_d, SPLITS=splits, ROTARY=rotary, Q_NORM=q_norm_eps is not None, num_warps=warps,
        num_stages=stages, **launch_options(q.device),
    )
    if splits > 1:
        _combine_splits_kernel[(tokens, heads)](
            part, stats, out, batch.positions, freq, heads, dim, rope_half, out.stride(0), out.stride(1),
            SPLITS=splits, BLOCK_D=block_d, ROTARY=rotary, num_warps=4, **launch_options(q.device),
        )
    return out if quantize_group is None else _quantized(out, quantize_group)


def _quantized(out: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output [T, H, d] as fp8 codes and scales [T, H * d / group] (`quantize_fp8_rows` of its token rows)."""
    codes, scales = quantize_fp8_rows(out.view(out.shape[0], -1), group)
    return codes.view(out.shape), scales
