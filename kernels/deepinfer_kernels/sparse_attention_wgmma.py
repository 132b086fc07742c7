"""Hopper's prefill attention: `sparse_attention`'s prefill launch (64 heads of one token a program, bf16,
head dim 512) written in Gluon, with the schedule Triton's `tl.dot` cannot express.

Why: the Triton kernel holds the [64, 512] float32 output in one 8-warp program a multiprocessor and runs
each key block as one dependent chain (scores, wait, softmax, rescale, value product), with both warp groups
forming the same scores; it reached ~100 TFLOP/s (BENCHMARKS.md, thirteenth session). Here:
- the two warp groups split both products by columns: each forms half of a key block's scores and owns
  half of the output's 512 columns, so no tensor work is repeated; the probabilities go through shared
  memory (a group needs all of a block's keys for its half of the output);
- the scores of key block j + 1 are issued (asynchronous wgmma) before block j's softmax, and block j's
  value product runs while block j + 1's scores are read, so the tensor cores work through the softmax;
- keys are gathered (window ring, this step's rows, compressed entries through the block table) by
  cp.async into a ring of four key buffers, blocks j + 2 and j + 3 in flight while block j is used; a block's
  row addresses are asked for at the top of the iteration that copies it and the indexer's picks an iteration
  before that (the block table's load depends on them: waiting for the two loads in a row was the loop's
  largest stall), and the copy leaves each key's visibility in shared memory for the softmax;
- a row's maximum is each warp group's half within its warps, then one exchange through shared memory;
- the epilogue de-rotates the output in shared memory before its one store (it was stored, read back and its
  rotated channels stored again: H100, V4's bf16 8,192-token step 51.82 / 52.03 -> 51.60 / 51.72 ms, the same
  bits); under W8A8 (QUANT_GROUP) it stores the fp8 codes and scales, the bits
  `quantize_fp8_rows` makes of the bf16 output: wo_a's input goes to memory once, in fp8.

Measured on an H100 (BENCHMARKS.md, thirty-sixth and thirty-seventh sessions): 1.2-2.0x the Triton kernel at
8,192 tokens (CSA 118 -> 237 TFLOP/s), V4's prefill step ~10% faster.

The keys are one run (the three sources one after another, a block may straddle two), so the online
softmax meets other key blocks than the Triton kernel's: the same result within rounding, not bit for bit.
Batch-invariant mode keeps the Triton kernel (its key blocks are aligned to the query's position).

Hopper only (wgmma): SM100's tensor cores take tcgen05 instead, and there the Triton kernel runs. Gluon has
no interpreter: CPU tests compile this kernel for sm_90 (tests/test_kernels_compile.py); its results are
checked on a GPU (tests/test_kernels_sparse_attention_wgmma.py, scripts/check_kernels_gpu.py).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from deepinfer_kernels.activation_quant import activation_group_supported, quantize_groups
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["HEADS", "HEAD_DIM", "quantizes_output", "wgmma_attention", "wgmma_attention_supported"]

HEADS = gl.constexpr(64)  # query heads a program (one warp group's MMA rows)
HEAD_DIM = gl.constexpr(512)  # DeepSeek-V4's shared KV head
KEYS = gl.constexpr(32)  # keys a block
BUFFERS = gl.constexpr(4)  # block j's value product, block j + 1's scores, blocks j + 2, j + 3's copies
WARPS = 8
Q_ROWS = gl.constexpr(16)  # heads a pass of the query's norm and rotation (registers)
# key copies: one key a thread of a row of eight (a row's address costs tens of integer instructions)
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0]))


@gluon.jit
def _block_keys(j0):
    """Key block j0..'s positions in the key run, as the copy holds them."""
    return j0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, COPY_LAYOUT))


@gluon.jit
def _picks(j, run, src, HAS_SELECTED: gl.constexpr):
    """The compressed entries keys j would stand for: the indexer's picks (a load, asked for a block before
    `_key_rows` needs them: the block table's load depends on them) or the visible entries in order.
    run: the token's key run (`_wgmma_attention_kernel`); src: the key sources' pointers and strides."""
    t, start, ctx, lo, step_lo, n_window, n_cached_and_step, total, visible, slot, table = run
    kv_ptr, window_ptr, entries_ptr, selected_ptr, stride_kv, stride_ws, stride_wp, stride_eb, stride_eo, \
        stride_sel = src
    e = j - n_cached_and_step
    if HAS_SELECTED:
        entry = (j >= n_cached_and_step) & (j < total)
        return gl.load(selected_ptr + t.to(gl.int64) * stride_sel + e, mask=entry, other=-1).to(gl.int32)
    else:
        return e


@gluon.jit
def _key_rows(j, w, run, src, HAS_SELECTED: gl.constexpr, RING: gl.constexpr, PER_BLOCK: gl.constexpr):
    """Row pointers of keys j (w: their `_picks`) and whether each is visible: ring positions lo.. (cached),
    this step's rows (fresh), then the compressed entries through the block table."""
    t, start, ctx, lo, step_lo, n_window, n_cached_and_step, total, visible, slot, table = run
    kv_ptr, window_ptr, entries_ptr, selected_ptr, stride_kv, stride_ws, stride_wp, stride_eb, stride_eo, \
        stride_sel = src
    cached = (j >= 0) & (j < n_window)
    fresh = (j >= n_window) & (j < n_cached_and_step)
    entry = (j >= n_cached_and_step) & (j < total)
    if HAS_SELECTED:
        entry = entry & (w >= 0) & (w < visible)
    block = gl.load(table + w // PER_BLOCK, mask=entry, other=0).to(gl.int64)
    ring_row = window_ptr + slot * stride_ws + ((lo + j) % RING).to(gl.int64) * stride_wp
    step_row = kv_ptr + (start + step_lo + (j - n_window) - ctx).to(gl.int64) * stride_kv
    entry_row = entries_ptr + block * stride_eb + (w % PER_BLOCK).to(gl.int64) * stride_eo
    row = gl.where(cached, ring_row, gl.where(fresh, step_row, entry_row))
    return row, cached | fresh | entry


@gluon.jit
def _rotation(position, freq_ptr, D, rope_half, SIGN: gl.constexpr, ROPE_BLOCK: gl.constexpr, layout: gl.constexpr):
    """Channels D - ROPE_BLOCK.. of a [rows, ROPE_BLOCK] tile in `layout`, whether each is rotated, and the
    cos / sin each channel's rotation takes (rounded to bf16 as `rope.rotate_tile`; sin signed for
    a cos - b sin on even channels, b cos + a sin on odd), once a program: cos / sin are many instructions."""
    cols = D - ROPE_BLOCK + gl.arange(0, ROPE_BLOCK, layout=gl.SliceLayout(0, layout))
    first = D - 2 * rope_half
    rotated = cols >= first
    angle = position.to(gl.float32) * gl.load(freq_ptr + (cols - first) // 2, mask=rotated, other=0.0)
    cos = gl.cos(angle).to(gl.bfloat16).to(gl.float32)
    sin = (SIGN * gl.sin(angle)).to(gl.bfloat16).to(gl.float32)
    return cols, rotated, cos, gl.where(cols % 2 == 0, -sin, sin)


@gluon.jit
def _rotate(x, partner, rotated, cos, sin):
    """x's rotated channels (partner: each channel's pair mate), in x's dtype."""
    out = (x.to(gl.float32) * cos[None, :] + partner.to(gl.float32) * sin[None, :]).to(x.dtype)
    return gl.where(rotated[None, :], out, x)


@gluon.jit
def _stage_query(q_smem, inv_smem, q_ptr, t, h0, H, position, freq_ptr, rope_half, q_eps, stride_qt, stride_qh,
                 D: gl.constexpr, ROTARY: gl.constexpr, Q_NORM: gl.constexpr, ROPE_BLOCK: gl.constexpr,
                 num_warps: gl.constexpr):
    """The token's query heads h0.. into shared memory, normalised and rotated as `KernelOps.rotary_attention`
    asks: whole rows Q_ROWS heads at a time (a [64, 512] block in registers would spill), then the rotated
    channels of all heads over them."""
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, rows_layout))
    for part in gl.static_range(HEADS // Q_ROWS):
        heads = h0 + part * Q_ROWS + gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, rows_layout))
        x = gl.load(q_ptr + t.to(gl.int64) * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                    mask=(heads < H)[:, None], other=0.0)
        if Q_NORM:  # as rms_norm without a weight: float32, rounded to q's dtype
            x32 = x.to(gl.float32)
            inv = gl.rsqrt(gl.sum(x32 * x32, axis=1) / D + q_eps)
            x = (x32 * inv[:, None]).to(x.dtype)
            inv_smem.slice(part * Q_ROWS, Q_ROWS).store(inv)
        q_smem.slice(part * Q_ROWS, Q_ROWS).store(x)
    if ROTARY:
        # each channel's pair mate read again from memory (not a register of this thread's): 1/8 of the row
        gl.thread_barrier()
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [num_warps, 1], [1, 0])
        rope_cols, rotated, cos, sin = _rotation(position, freq_ptr, D, rope_half, 1.0, ROPE_BLOCK, rope_layout)
        heads = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, rope_layout))
        base = q_ptr + t.to(gl.int64) * stride_qt + heads[:, None] * stride_qh
        live = (heads < H)[:, None]
        x = gl.load(base + rope_cols[None, :], mask=live, other=0.0)
        partner = gl.load(base + (rope_cols ^ 1)[None, :], mask=live, other=0.0)
        if Q_NORM:
            inv = inv_smem.load(gl.SliceLayout(1, rope_layout))[:, None]
            x = (x.to(gl.float32) * inv).to(x.dtype)
            partner = (partner.to(gl.float32) * inv).to(x.dtype)
        q_smem.slice(D - ROPE_BLOCK, ROPE_BLOCK, dim=1).store(_rotate(x, partner, rotated, cos, sin))


@gluon.jit
def _copy_keys(k_buffer, mask_buffer, row, ok, D: gl.constexpr):
    """cp.async of a key block into k_buffer, 16 bytes a copy (the caller commits the group), and its visibility
    into mask_buffer for the softmax; keys past the end or not visible are zeros (their scores are masked, and
    a zero row cannot turn a masked product into NaN)."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, COPY_LAYOUT))
    async_copy.async_copy_global_to_shared(k_buffer, row[:, None] + cols[None, :], mask=ok[:, None])
    mask_buffer.store(ok.to(gl.int8))


@gluon.jit
def _row_max(s, red_smem, s_layout: gl.constexpr):
    """Each row's maximum over both warp groups' columns: each group's own half within its warps, then one
    exchange through shared memory (one barrier; a reduction over the whole tile takes two)."""
    part = gl.max(gl.reshape(s, [HEADS, 2, KEYS // 2]), axis=2)
    red_smem.store(gl.reshape(gl.permute(part, (1, 0)), [2 * HEADS]))
    gl.thread_barrier()
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    return gl.maximum(red_smem.slice(0, HEADS).load(rows), red_smem.slice(HEADS, HEADS).load(rows))


@gluon.jit
def _softmax(s, ok, m_i, l_part, scale, red_smem, s_layout: gl.constexpr):
    """One key block's probabilities (float32, masked), the new running max, its rescaling factor and
    the per-thread partial row sums (reduced once, after the last block). Logits rounded as the reference
    forms them in bf16: the product, then the scaled product."""
    s = (s.to(gl.bfloat16).to(gl.float32) * scale).to(gl.bfloat16).to(gl.float32)
    s = gl.where(ok[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(s, red_smem, s_layout))
    alpha = gl.exp(m_i - m_new)
    p = gl.exp(s - m_new[:, None])
    return p, m_new, alpha, l_part * alpha[:, None] + p


@gluon.jit
def _attend_block(s, j, acc, m_i, l_part, scale, k_smem, p_smem, mask_smem, red_smem, s_layout: gl.constexpr,
                  o_layout: gl.constexpr):
    """Key block j from its scores s: softmax and the probabilities into shared memory (while block j + 1's
    scores are formed); the output rescaled once block j - 1's value product is done; then block j's value
    product, left running. Returns with every group's product of block j - 1 done (its key buffer free)."""
    ok = mask_smem.index(j % BUFFERS).load(gl.SliceLayout(0, s_layout)) != 0
    p, m_i, alpha, l_part = _softmax(s, ok, m_i, l_part, scale, red_smem, s_layout)
    p_buffer = p_smem.index(j % 2)  # last read by block j - 2's value product, waited for a block ago
    p_buffer.store(p.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # both groups' probabilities stored
    # (waiting for block j - 1's product alone, block j + 1's scores left running, made ptxas serialise every
    # wgmma of the kernel for want of registers: its warning C7511)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma(p_buffer, k_smem.index(j % BUFFERS), acc, is_async=True)
    gl.thread_barrier()
    return acc, m_i, l_part


@gluon.jit
def _wgmma_attention_kernel(
    q_ptr, kv_ptr, window_ptr, sinks_ptr, entries_ptr, selected_ptr, out_ptr,
    token_seq_ptr, query_start_ptr, context_lens_ptr, slot_ids_ptr, block_tables_ptr, positions_ptr, window_starts_ptr,
    freq_ptr, H, ratio, top_k, scale, rope_half, q_eps,
    stride_qt, stride_qh, stride_kv, stride_ws, stride_wp, stride_eb, stride_eo, stride_sel, stride_bt,
    stride_ot, stride_oh, scales_ptr, stride_st,
    HAS_ENTRIES: gl.constexpr, HAS_SELECTED: gl.constexpr, HAS_WINDOW_STARTS: gl.constexpr, RING: gl.constexpr,
    PER_BLOCK: gl.constexpr, ROTARY: gl.constexpr, Q_NORM: gl.constexpr, ROPE_BLOCK: gl.constexpr,
    QUANT_GROUP: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):
    wait_for_previous_grid(PDL)
    D: gl.constexpr = HEAD_DIM
    # Scores [64, 32] and output [64, 512]: warp group g holds columns of half g of each (warps [4, 2]).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, KEYS // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D // 2, 16])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, D], gl.NVMMASharedLayout.get_default_for(
        [HEADS, D], gl.bfloat16))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, KEYS, D], gl.NVMMASharedLayout.get_default_for(
        [KEYS, D], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, KEYS], gl.NVMMASharedLayout.get_default_for(
        [HEADS, KEYS], gl.bfloat16))
    inv_smem = gl.allocate_shared_memory(gl.float32, [HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    mask_smem = gl.allocate_shared_memory(gl.int8, [BUFFERS, KEYS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    red_smem = gl.allocate_shared_memory(gl.float32, [2 * HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    t = gl.program_id(0)
    h0 = gl.program_id(1) * HEADS
    seq = gl.load(token_seq_ptr + t)
    start = gl.load(query_start_ptr + seq)
    ctx = gl.load(context_lens_ptr + seq)
    slot = gl.load(slot_ids_ptr + seq).to(gl.int64)
    pos = gl.load(positions_ptr + t).to(gl.int32)
    lo = gl.maximum(pos - RING + 1, 0)
    if HAS_WINDOW_STARTS:  # bounded prefix replay: no window KV below the sequence's replay start
        lo = gl.maximum(lo, gl.load(window_starts_ptr + seq))
    # the key run: ring positions lo..ctx-1, this step's rows step_lo..pos, then the compressed entries
    step_lo = gl.maximum(lo, ctx)
    n_window = gl.maximum(ctx - lo, 0)
    n_cached_and_step = n_window + gl.maximum(pos + 1 - step_lo, 0)
    visible = (pos + 1) // ratio
    total = n_cached_and_step
    if HAS_ENTRIES:
        if HAS_SELECTED:
            total += top_k
        else:
            total += visible
    table = block_tables_ptr + seq.to(gl.int64) * stride_bt
    blocks = gl.cdiv(total, KEYS)
    run = (t, start, ctx, lo, step_lo, n_window, n_cached_and_step, total, visible, slot, table)
    src = (kv_ptr, window_ptr, entries_ptr, selected_ptr, stride_kv, stride_ws, stride_wp, stride_eb, stride_eo,
           stride_sel)

    for b in gl.static_range(BUFFERS - 1):  # blocks 0.. in flight while the query is staged
        j = _block_keys(b * KEYS)
        row, ok = _key_rows(j, _picks(j, run, src, HAS_SELECTED), run, src, HAS_SELECTED, RING, PER_BLOCK)
        _copy_keys(k_smem.index(b), mask_smem.index(b), row, ok, D)
        async_copy.commit_group()
    _stage_query(q_smem, inv_smem, q_ptr, t, h0, H, pos, freq_ptr, rope_half, q_eps, stride_qt, stride_qh, D,
                 ROTARY, Q_NORM, ROPE_BLOCK, num_warps)
    async_copy.wait_group(BUFFERS - 2)
    fence_async_shared()
    gl.thread_barrier()

    picks = _picks(_block_keys((BUFFERS - 1) * KEYS), run, src, HAS_SELECTED)
    zero_s = gl.zeros([HEADS, KEYS], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    heads = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
    # the sink starts the running max and sum (its probability is dropped)
    m_i = gl.load(sinks_ptr + heads, mask=heads < H, other=0.0).to(gl.float32)
    sink = m_i
    l_part = gl.zeros([HEADS, KEYS], gl.float32, s_layout)
    acc = warpgroup_mma_init(gl.zeros([HEADS, D], gl.float32, o_layout))
    for j in range(blocks - 1):
        # s: block j's scores, its keys in buffer j % 4; blocks j + 1, j + 2's copies in flight. Block j + 3 is
        # copied at the end of this iteration into block j - 1's buffer: its rows are asked for now (the block
        # table's load runs under the scores and the softmax), the picks of the block after for the next one.
        ahead = j + BUFFERS - 1
        keys = _block_keys(ahead * KEYS)
        row, ok = _key_rows(keys, picks, run, src, HAS_SELECTED, RING, PER_BLOCK)
        picks = _picks(keys + KEYS, run, src, HAS_SELECTED)
        async_copy.wait_group(BUFFERS - 3)
        fence_async_shared()
        gl.thread_barrier()
        s_next = warpgroup_mma(q_smem, k_smem.index((j + 1) % BUFFERS).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        acc, m_i, l_part = _attend_block(s, j, acc, m_i, l_part, scale, k_smem, p_smem, mask_smem, red_smem,
                                         s_layout, o_layout)
        if ahead < blocks:
            _copy_keys(k_smem.index(ahead % BUFFERS), mask_smem.index(ahead % BUFFERS), row, ok, D)
        async_copy.commit_group()  # (maybe empty: one group a block keeps the waits' counts)
        s = warpgroup_mma_wait(1, deps=(s_next,))  # block j + 1's scores; block j's value product may run on
    acc, m_i, l_part = _attend_block(s, blocks - 1, acc, m_i, l_part, scale, k_smem, p_smem, mask_smem, red_smem,
                                     s_layout, o_layout)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    total_p = gl.sum(l_part, axis=1) + gl.exp(sink - m_i)
    out = (acc / gl.convert_layout(total_p, gl.SliceLayout(1, o_layout))[:, None]).to(gl.bfloat16)
    # through shared memory (the query's, free now): de-rotated there, then stored in 16-byte runs of whole rows
    q_smem.store(out)
    gl.thread_barrier()
    if ROTARY:
        _derotate_in_shared(q_smem, pos, freq_ptr, rope_half, D, ROPE_BLOCK, num_warps)
    if QUANT_GROUP:
        _store_quantized(q_smem, out_ptr, scales_ptr, t, h0, H, stride_ot, stride_oh, stride_st, D, QUANT_GROUP,
                         num_warps)
    else:
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        out = q_smem.load(store_layout)
        rows = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, store_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, store_layout))
        out_rows = out_ptr + t.to(gl.int64) * stride_ot + rows[:, None] * stride_oh
        gl.store(out_rows + cols[None, :], out, mask=(rows < H)[:, None])


@gluon.jit
def _derotate_in_shared(o_smem, pos, freq_ptr, rope_half, D: gl.constexpr, ROPE_BLOCK: gl.constexpr,
                        num_warps: gl.constexpr):
    """The output's rotated channels de-rotated where they lie in shared memory: a thread holds both channels
    of its pairs (two adjacent columns), so it writes back only what it read."""
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [num_warps, 1], [1, 0])
    _, rotated, cos, sin = _rotation(pos, freq_ptr, D, rope_half, -1.0, ROPE_BLOCK, rope_layout)
    channels = o_smem.slice(D - ROPE_BLOCK, ROPE_BLOCK, dim=1)
    x = channels.load(rope_layout)
    even, odd = gl.split(gl.reshape(x, [HEADS, ROPE_BLOCK // 2, 2]))
    partner = gl.convert_layout(gl.reshape(gl.join(odd, even), [HEADS, ROPE_BLOCK]), rope_layout)
    channels.store(_rotate(x, partner, rotated, cos, sin))
    gl.thread_barrier()


@gluon.jit
def _store_quantized(o_smem, codes_ptr, scales_ptr, t, h0, H, stride_ct, stride_ch, stride_st, D: gl.constexpr,
                     GROUP: gl.constexpr, num_warps: gl.constexpr):
    """The bf16 output in shared memory stored as fp8 codes and float32 scales, each head row's GROUP columns
    sharing a scale: `activation_quant.quantize_groups`, the same bits as `quantize_fp8_rows` of the bf16
    output's token rows. Scales of token t, head h, group g at scales_ptr + t * stride_st + h * (D // GROUP) + g."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // GROUP, GROUP // 8], [num_warps, 1], [1, 0])
    rows = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, GROUP, layout=gl.SliceLayout(0, layout))
    live = rows < H
    code_rows = codes_ptr + t.to(gl.int64) * stride_ct + rows[:, None] * stride_ch
    scale_rows = scales_ptr + t.to(gl.int64) * stride_st + rows * (D // GROUP)
    for g in gl.static_range(D // GROUP):
        values = o_smem.slice(g * GROUP, GROUP, dim=1).load(layout).to(gl.float32)
        codes, scales = quantize_groups(values, 1)
        gl.store(code_rows + g * GROUP + cols[None, :], codes.to(codes_ptr.dtype.element_ty), mask=live[:, None])
        gl.store(scale_rows + g, scales, mask=live)


def wgmma_attention_supported(q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor, entries: torch.Tensor | None,
                              rope_half: int) -> bool:
    """Whether this kernel takes the step: a Hopper GPU, bf16 query and keys from every source, head dim
    HEAD_DIM, the rotated channels within it, key rows on 16-byte boundaries (cp.async copies 16 bytes)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    sources = (kv, window) if entries is None else (kv, window, entries)
    return (q.dtype == torch.bfloat16 and q.shape[-1] == HEAD_DIM.value and 2 * rope_half <= HEAD_DIM.value
            and all(x.dtype == torch.bfloat16 and _rows_aligned(x) for x in sources))


def quantizes_output(group: int | None) -> bool:
    """Whether the launch stores its output as fp8 codes in groups of `group` columns: a power of two from 16 to 256,
    so whole groups a head (HEAD_DIM 512), each a [64, group] tile of the epilogue."""
    return group is not None and activation_group_supported((group, group))


def _rows_aligned(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(stride % 8 == 0 for stride in x.stride()[:-1])


def wgmma_attention(q, kv, window, sinks, scale, batch, out, token_seq, window_starts, entries, ratio, selected,
                    freq, rope_half, q_norm_eps, scales=None, group=0) -> None:
    """`sparse_attention`'s prefill launch into `out` (arguments as there: entries / selected may be None;
    freq / rope_half: the rotation, rope_half = 0 for none). With a `group` (`quantizes_output`), out takes the
    output's fp8 codes and scales [T, H * HEAD_DIM / group] their scales."""
    tokens, heads, _ = q.shape
    has_entries = entries is not None
    entries_arg = entries if has_entries else kv
    selected_arg = selected if selected is not None else token_seq
    rope_block = triton.next_power_of_2(max(2 * rope_half, 2))
    _wgmma_attention_kernel[(tokens, triton.cdiv(heads, HEADS.value))](
        q, kv, window, sinks, entries_arg, selected_arg, out,
        token_seq, batch.query_start_loc, batch.context_lens, batch.slot_ids, batch.block_tables, batch.positions,
        window_starts, freq, heads, max(ratio, 1), selected.shape[1] if selected is not None else 0, scale, rope_half,
        q_norm_eps or 0.0,
        q.stride(0), q.stride(1), kv.stride(0), window.stride(0), window.stride(1),
        entries_arg.stride(0), entries_arg.stride(1) if has_entries else 0,
        selected_arg.stride(0), batch.block_tables.stride(0), out.stride(0), out.stride(1),
        out if scales is None else scales, 0 if scales is None else scales.stride(0),
        HAS_ENTRIES=has_entries, HAS_SELECTED=selected is not None,
        HAS_WINDOW_STARTS=batch.window_starts_cpu is not None, RING=window.shape[1],
        PER_BLOCK=entries.shape[1] if has_entries else 1, ROTARY=rope_half > 0,
        Q_NORM=q_norm_eps is not None, ROPE_BLOCK=rope_block, QUANT_GROUP=group, num_warps=WARPS,
        **launch_options(q.device),
    )
