"""`KernelOps.compress_kv` for any step in two launches: the closed windows' entries, then the states.

Launch 1 runs a program per (sequence, window the step may close): a window the step does close pools
its slots (softmax-gated sum, in chunks of slots so that the 128-token windows of HCA fit in registers),
normalises, rotates and writes its entry. A slot's raw projections come from the sequence's state for
positions cached before the step and from the step's rows for the others. Launch 2 then writes the
last `span` positions of each sequence into its state (after launch 1: a window may still read a state
row that one of the step's positions replaces). In a decode step (`is_decode_step`: one token per
sequence) launch 1 writes the token's state itself, which no window of that step reads, so it is the
only launch; it reads only the batch's device tensors and can be captured in a graph. The pooling keeps
the reference's roundings: probabilities and products in the state dtype, RMSNorm and RoPE outputs in the
state dtype, then the entries' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["compress_kv", "compress_supported", "is_decode_step"]

# Elements of one [slots, channels] tile: 4096 float32 are 32 registers per thread at 4 warps.
TILE_ELEMENTS = 4096
# The V4 cache's dtypes (the model dtype); Triton's float8 casts saturate where torch's `.to` does not.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _window_slots(
    j, ch, in_width, window, ctx, row0, slot, kv_ptr, gate_ptr, stride_kv, stride_gate, ape_ptr, state_kv_ptr,
    state_gate_ptr, stride_slot, stride_pos, P, width, span, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
):
    """(gate + ape as float32, kv as float32) [CHUNK, BLOCK_W] at slots `j` of the pooling: with overlap,
    slots < RATIO are the previous window's tokens (channels :width; absent for window 0: gate -inf,
    kv 0) and the rest the own window's (channels width:). Positions below ctx are read from the state,
    the others from the step's rows (position ctx is row row0)."""
    dtype = state_kv_ptr.dtype.element_ty
    num_slots = 2 * RATIO if OVERLAP else RATIO
    token = j % RATIO
    if OVERLAP:
        from_prev = j < RATIO
        present = (j < num_slots) & ((j >= RATIO) | (window > 0))
        pos = tl.maximum(window - from_prev.to(tl.int64), 0) * RATIO + token
        col = tl.where(from_prev, 0, width)
    else:
        present = j < num_slots
        pos = window * RATIO + token
        col = tl.zeros_like(j)
    from_step = present & (pos >= ctx)
    from_state = present & (pos < ctx)
    row = row0 + pos - ctx
    at_state = (slot * stride_slot + (pos % span) * stride_pos + col)[:, None] + ch[None, :]
    state_mask = from_state[:, None] & in_width[None, :]
    step_mask = from_step[:, None] & in_width[None, :]
    gate = tl.where(
        step_mask,
        tl.load(gate_ptr + (row * stride_gate + col)[:, None] + ch[None, :], mask=step_mask, other=0.0)
        .to(dtype).to(tl.float32),
        tl.load(state_gate_ptr + at_state, mask=state_mask, other=0.0).to(tl.float32),
    )
    kv = tl.where(
        step_mask,
        tl.load(kv_ptr + (row * stride_kv + col)[:, None] + ch[None, :], mask=step_mask, other=0.0)
        .to(dtype).to(tl.float32),
        tl.load(state_kv_ptr + at_state, mask=state_mask, other=0.0).to(tl.float32),
    )
    live = present[:, None] & in_width[None, :]
    gate = gate + tl.load(ape_ptr + token[:, None] * P + col[:, None] + ch[None, :], mask=live, other=0.0)
    # channels past `width` stay finite (0) so that no NaN appears; they are never stored
    gate = tl.where(in_width[None, :], tl.where(present[:, None], gate, float("-inf")), 0.0)
    return gate, kv


@triton.jit
def _compress_windows_kernel(
    kv_ptr, gate_ptr, stride_kv, stride_gate, ape_ptr, norm_ptr, freq_ptr, state_kv_ptr, state_gate_ptr,
    stride_slot, stride_pos, entries_ptr, stride_block, stride_entry, slot_ptr, ctx_ptr, start_ptr, table_ptr,
    stride_table, P, width, span, block_size, eps, RATIO: tl.constexpr, OVERLAP: tl.constexpr, HALF: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    seq = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq).to(tl.int64)
    row0 = tl.load(start_ptr + seq).to(tl.int64)
    end = ctx + tl.load(start_ptr + seq + 1).to(tl.int64) - row0
    dtype = state_kv_ptr.dtype.element_ty
    if ONE_TOKEN:  # the token's state: no window of a one-token step reads that row
        cols = tl.arange(0, BLOCK_P)
        in_row = cols < P
        at = slot * stride_slot + (ctx % span) * stride_pos + cols
        tl.store(state_kv_ptr + at, tl.load(kv_ptr + row0 * stride_kv + cols, mask=in_row).to(dtype), mask=in_row)
        tl.store(state_gate_ptr + at, tl.load(gate_ptr + row0 * stride_gate + cols, mask=in_row).to(dtype),
                 mask=in_row)

    window = ctx // RATIO + tl.program_id(1)
    if window < end // RATIO:
        num_slots: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
        ch = tl.arange(0, BLOCK_W)
        in_width = ch < width
        # softmax over the slots per channel: running max and sum first, then the weighted sum
        top = tl.full([BLOCK_W], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_W], tl.float32)
        for start in tl.range(0, num_slots, CHUNK):
            gate, _ = _window_slots(
                start + tl.arange(0, CHUNK), ch, in_width, window, ctx, row0, slot, kv_ptr, gate_ptr, stride_kv,
                stride_gate, ape_ptr, state_kv_ptr, state_gate_ptr, stride_slot, stride_pos, P, width, span,
                RATIO, OVERLAP,
            )
            new_top = tl.maximum(top, tl.max(gate, axis=0))
            # a chunk of absent slots only (window 0's previous tokens) leaves the max at -inf
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - shift) + tl.sum(tl.exp(gate - shift[None, :]), axis=0)
            top = new_top
        acc = tl.zeros([BLOCK_W], tl.float32)
        for start in tl.range(0, num_slots, CHUNK):
            gate, kv = _window_slots(
                start + tl.arange(0, CHUNK), ch, in_width, window, ctx, row0, slot, kv_ptr, gate_ptr, stride_kv,
                stride_gate, ape_ptr, state_kv_ptr, state_gate_ptr, stride_slot, stride_pos, P, width, span,
                RATIO, OVERLAP,
            )
            probs = (tl.exp(gate - top[None, :]) / total[None, :]).to(dtype).to(tl.float32)
            acc += tl.sum((kv * probs).to(dtype).to(tl.float32), axis=0)
        pooled = acc.to(dtype).to(tl.float32)

        normed = pooled * tl.rsqrt(tl.sum(pooled * pooled, axis=0) / width + eps)
        normed = (normed * tl.load(norm_ptr + ch, mask=in_width, other=0.0)).to(dtype).to(tl.float32)

        # interleaved RoPE of the trailing 2*HALF channels at position window*RATIO
        even, odd = tl.split(tl.reshape(normed, (BLOCK_W // 2, 2)))
        pair = tl.arange(0, BLOCK_W // 2) - (width // 2 - HALF)
        rotates = (pair >= 0) & (pair < HALF)
        angle = (window * RATIO).to(tl.float32) * tl.load(freq_ptr + pair, mask=rotates, other=0.0)
        cos = tl.cos(angle).to(dtype).to(tl.float32)
        sin = tl.sin(angle).to(dtype).to(tl.float32)
        even, odd = tl.where(rotates, even * cos - odd * sin, even), tl.where(rotates, odd * cos + even * sin, odd)
        entry = tl.reshape(tl.join(even, odd), (BLOCK_W,)).to(dtype)

        first = window * RATIO
        block = tl.load(table_ptr + seq * stride_table + first // block_size).to(tl.int64)
        target = entries_ptr + block * stride_block + ((first % block_size) // RATIO) * stride_entry + ch
        tl.store(target, entry.to(entries_ptr.dtype.element_ty), mask=in_width)


@triton.jit
def _store_states_kernel(
    kv_ptr, gate_ptr, stride_kv, stride_gate, state_kv_ptr, state_gate_ptr, stride_slot, stride_pos, slot_ptr,
    ctx_ptr, start_ptr, P, span, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, j): the j-th of sequence i's last min(q, span) positions into its state."""
    wait_for_previous_grid(PDL)
    seq = tl.program_id(0).to(tl.int64)
    row0 = tl.load(start_ptr + seq).to(tl.int64)
    q = tl.load(start_ptr + seq + 1).to(tl.int64) - row0
    kept = tl.minimum(q, span)
    j = tl.program_id(1)
    if j < kept:
        row = row0 + q - kept + j
        pos = tl.load(ctx_ptr + seq).to(tl.int64) + q - kept + j
        at = tl.load(slot_ptr + seq).to(tl.int64) * stride_slot + (pos % span) * stride_pos
        dtype = state_kv_ptr.dtype.element_ty
        for c0 in tl.range(0, P, BLOCK_P):
            cols = c0 + tl.arange(0, BLOCK_P)
            ok = cols < P
            tl.store(state_kv_ptr + at + cols, tl.load(kv_ptr + row * stride_kv + cols, mask=ok).to(dtype), mask=ok)
            tl.store(state_gate_ptr + at + cols, tl.load(gate_ptr + row * stride_gate + cols, mask=ok).to(dtype),
                     mask=ok)


def is_decode_step(batch: ForwardBatch) -> bool:
    """Every sequence of the step brings one token (`compress_kv` is then one graph-capturable launch)."""
    return all(n == 1 for n in batch.query_lens_cpu)


def compress_supported(state_kv: torch.Tensor, entries: torch.Tensor) -> bool:
    """States and entries in `SUPPORTED_DTYPES`."""
    return state_kv.dtype in SUPPORTED_DTYPES and entries.dtype in SUPPORTED_DTYPES


def compress_kv(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    inv_freq: torch.Tensor,
    ratio: int,
    overlap: bool,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    entries: torch.Tensor,
    batch: ForwardBatch,
) -> None:
    """`KernelOps.compress_kv` (same arguments) with state_kv / state_gate [num_slots, span, P] and entries
    [num_blocks, block_size // ratio, width] in `SUPPORTED_DTYPES` (`compress_supported`). A decode step
    reads only the batch's device tensors; other steps size their grids from the host's query lengths.
    """
    for name, tensor in (("state", state_kv), ("entries", entries)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"compress_kv kernel: {name} dtype {tensor.dtype} is not supported (expected one of "
                f"{SUPPORTED_DTYPES}); use the reference KernelOps.compress_kv for it"
            )
    if state_gate.stride() != state_kv.stride() or state_kv.stride(-1) != 1 or entries.stride(-1) != 1:
        raise ValueError(
            f"compress_kv kernel: expected state_kv / state_gate of equal strides and states and entries "
            f"with contiguous rows, got strides {state_kv.stride()}, {state_gate.stride()}, {entries.stride()}"
        )
    seqs, proj = len(batch.query_lens_cpu), kv.shape[1]
    if seqs == 0 or kv.shape[0] == 0:
        return
    width, half, span = entries.shape[-1], inv_freq.shape[0], state_kv.shape[1]
    kv, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate))
    block_w = triton.next_power_of_2(width)
    num_slots = 2 * ratio if overlap else ratio
    one_token = is_decode_step(batch)
    longest = max(batch.query_lens_cpu)
    # windows a sequence's step can close: (ctx + q) // ratio - ctx // ratio <= (q - 1) // ratio + 1
    windows = (longest - 1) // ratio + 1
    sequences = (batch.slot_ids, batch.context_lens, batch.query_start_loc)
    _compress_windows_kernel[(seqs, windows)](
        kv, gate, kv.stride(0), gate.stride(0), ape.float().contiguous(), norm_weight.float().contiguous(),
        inv_freq.float().contiguous(), state_kv, state_gate, state_kv.stride(0), state_kv.stride(1), entries,
        entries.stride(0), entries.stride(1), *sequences, batch.block_tables, batch.block_tables.stride(0),
        proj, width, span, ratio * entries.shape[1], norm_eps, RATIO=ratio, OVERLAP=overlap, HALF=half,
        BLOCK_P=triton.next_power_of_2(proj), BLOCK_W=block_w,
        CHUNK=min(triton.next_power_of_2(num_slots), max(1, TILE_ELEMENTS // block_w)), ONE_TOKEN=one_token,
        **launch_options(kv.device),
    )
    if not one_token:
        _store_states_kernel[(seqs, min(longest, span))](
            kv, gate, kv.stride(0), gate.stride(0), state_kv, state_gate, state_kv.stride(0), state_kv.stride(1),
            *sequences, proj, span, BLOCK_P=min(triton.next_power_of_2(proj), 1024), **launch_options(kv.device),
        )
