"""Hyper-connection (mHC) kernels: the mixing coefficients with their Sinkhorn normalisation in one
pass over the streams, the collapse to a block input, and the stream update after a block.

Every program owns whole rows (tokens) and reduces in a fixed order, so a row's result never depends
on the other rows of the batch (batch-invariant by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["hc_collapse", "hc_head_weights", "hc_mix", "hc_update"]


# The K reduction is split into chunks reduced afterwards in chunk order. Prefill-sized steps and the
# batch-invariant mode use _CHUNK columns (the same order for every batch); steps of up to
# _SMALL_STEP rows use _SMALL_CHUNK, so that a decode step still spreads over the GPU (16 programs
# for one row at V4-Flash width otherwise).
_CHUNK = 1024
_SMALL_CHUNK = 256
_SMALL_STEP = 64


@triton.jit
def _hc_mix_partial_kernel(
    x_ptr, fn_ptr, part_ptr, T, K,
    N: tl.constexpr, NP: tl.constexpr, PN: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PRE_ONLY: tl.constexpr,
):
    # Partial dot products of one K chunk: part[chunk, t] = [pre (PN) | post (PN) | comb (NP*NP) | sum x^2].
    # PRE_ONLY (the final head, fn [N, K]): the post and comb parts stay 0.
    # NP: n padded to a power of two >= 4 so the comb tile [NP*NP] is a legal dot width (>= 16);
    # PN: width of the pre / post tiles (>= 16 for the same reason).
    chunk = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols_pn = tl.arange(0, PN)
    cells = tl.arange(0, NP * NP)
    cell_r, cell_c = cells // NP, cells % NP
    cell_ok = (cell_r < N) & (cell_c < N)
    comb_rows = 2 * N + cell_r * N + cell_c
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc_pre = tl.zeros([BLOCK_T, PN], dtype=tl.float32)
    acc_post = tl.zeros([BLOCK_T, PN], dtype=tl.float32)
    acc_comb = tl.zeros([BLOCK_T, NP * NP], dtype=tl.float32)
    for k0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        w_pre = tl.load(fn_ptr + cols_pn[None, :] * K + ks[:, None], mask=(cols_pn < N)[None, :] & k_ok[:, None], other=0.0)
        acc_pre += tl.dot(x, w_pre, input_precision=PRECISION)
        if not PRE_ONLY:
            w_post = tl.load(fn_ptr + (N + cols_pn)[None, :] * K + ks[:, None],
                             mask=(cols_pn < N)[None, :] & k_ok[:, None], other=0.0)
            w_comb = tl.load(fn_ptr + comb_rows[None, :] * K + ks[:, None], mask=cell_ok[None, :] & k_ok[:, None], other=0.0)
            acc_post += tl.dot(x, w_post, input_precision=PRECISION)
            acc_comb += tl.dot(x, w_comb, input_precision=PRECISION)
    out = part_ptr + (chunk * T + rows.to(tl.int64))[:, None] * WIDTH
    tl.store(out + cols_pn[None, :], acc_pre, mask=row_ok[:, None])
    tl.store(out + PN + cols_pn[None, :], acc_post, mask=row_ok[:, None])
    tl.store(out + 2 * PN + cells[None, :], acc_comb, mask=row_ok[:, None])
    tl.store(part_ptr + (chunk * T + rows.to(tl.int64)) * WIDTH + 2 * PN + NP * NP, squares, mask=row_ok)


@triton.jit
def _hc_mix_epilogue_kernel(
    part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, CHUNKS, norm_eps, hc_eps,
    N: tl.constexpr, NP: tl.constexpr, PN: tl.constexpr, WIDTH: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr, PRE_ONLY: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols_pn = tl.arange(0, PN)
    cells = tl.arange(0, NP * NP)
    cell_r, cell_c = cells // NP, cells % NP
    cell_ok = (cell_r < N) & (cell_c < N)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc_pre = tl.zeros([BLOCK_T, PN], dtype=tl.float32)
    acc_post = tl.zeros([BLOCK_T, PN], dtype=tl.float32)
    acc_comb = tl.zeros([BLOCK_T, NP * NP], dtype=tl.float32)
    for chunk in range(CHUNKS):
        part = part_ptr + (chunk * T + rows.to(tl.int64))[:, None] * WIDTH
        acc_pre += tl.load(part + cols_pn[None, :], mask=row_ok[:, None], other=0.0)
        acc_post += tl.load(part + PN + cols_pn[None, :], mask=row_ok[:, None], other=0.0)
        acc_comb += tl.load(part + 2 * PN + cells[None, :], mask=row_ok[:, None], other=0.0)
        squares += tl.load(part_ptr + (chunk * T + rows.to(tl.int64)) * WIDTH + 2 * PN + NP * NP, mask=row_ok, other=0.0)
    # fn @ (x * r) == r * (fn @ x): the RMS factor is applied once, after the reduction.
    r = tl.rsqrt(squares / K + norm_eps)[:, None]
    pn_ok = cols_pn < N
    out_ok = row_ok[:, None] & pn_ok[None, :]
    pre = tl.sigmoid(acc_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + cols_pn, mask=pn_ok, other=0.0)[None, :])
    tl.store(pre_ptr + rows[:, None] * N + cols_pn[None, :], pre + hc_eps, mask=out_ok)
    if PRE_ONLY:
        return
    post = 2.0 * tl.sigmoid(acc_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + cols_pn, mask=pn_ok, other=0.0)[None, :])
    tl.store(post_ptr + rows[:, None] * N + cols_pn[None, :], post, mask=out_ok)
    s2 = tl.load(scale_ptr + 2)

    logits = acc_comb * r * s2 + tl.load(base_ptr + 2 * N + cell_r * N + cell_c, mask=cell_ok, other=0.0)[None, :]
    logits = tl.reshape(logits, [BLOCK_T, NP, NP])
    r3 = tl.reshape(cell_r, [NP, NP])[None, :, :]
    c3 = tl.reshape(cell_c, [NP, NP])[None, :, :]
    ok3 = (r3 < N) & (c3 < N)
    # padded rows get finite logits (no NaN from an all -inf row); padded cells end at exactly 0
    logits = tl.where(ok3, logits, tl.where(r3 < N, float("-inf"), 0.0))
    logits = logits - tl.max(logits, axis=2)[:, :, None]
    e = tl.exp(logits)
    comb = tl.where(ok3, e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    rows3 = tl.reshape(rows, [BLOCK_T, 1, 1])
    tl.store(comb_ptr + rows3 * (N * N) + r3 * N + c3, comb, mask=(rows3 < T) & ok3)


def hc_mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int, batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) float32 of `KernelOps.hc_mix`, one pass over the streams.

    The float32 dot products run as 3xTF32 on tensor cores (float32-level accuracy). batch_invariant
    fixes the row tile (otherwise 64 rows for prefill-sized steps, 16 for decode-sized ones).
    """
    return _mix(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant, pre_only=False)


def hc_head_weights(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, batch_invariant: bool = False,
) -> torch.Tensor:
    """The final head's collapse weights [T, n] float32 (`KernelOps.hc_head`'s pre, fn [n, n*D], base
    [n], scale [1]): `hc_mix`'s pre from the same two launches, without the post and comb terms."""
    return _mix(streams, fn, base, scale, norm_eps, hc_eps, 1, batch_invariant, pre_only=True)[0]


def _mix(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant, pre_only):
    t, n, d = streams.shape
    x = streams.reshape(t, n * d)
    if x.stride(-1) != 1 or x.stride(0) != n * d:
        x = x.contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    if t == 0:
        return pre, post, comb
    k = n * d
    np_, pn = max(4, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(n))
    width = 2 * pn + np_ * np_ + 1
    chunk = _SMALL_CHUNK if t <= _SMALL_STEP and not batch_invariant else _CHUNK
    chunks = triton.cdiv(k, chunk)
    parts = torch.empty(chunks, t, width, dtype=torch.float32, device=streams.device)
    block_t = 16 if batch_invariant or t <= 64 else 64
    _hc_mix_partial_kernel[(triton.cdiv(t, block_t), chunks)](
        x, fn.float().contiguous(), parts, t, k,
        N=n, NP=np_, PN=pn, WIDTH=width, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=64, PRECISION="tf32x3",
        PRE_ONLY=pre_only, num_warps=4,
    )
    _hc_mix_epilogue_kernel[(triton.cdiv(t, 16),)](
        parts, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, k, chunks,
        norm_eps, hc_eps, N=n, NP=np_, PN=pn, WIDTH=width, ITERS=sinkhorn_iters, BLOCK_T=16, PRE_ONLY=pre_only,
    )
    return pre, post, comb


@triton.jit
def _hc_collapse_kernel(s_ptr, pre_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(N):
        w = tl.load(pre_ptr + row * N + i)
        acc += w * tl.load(s_ptr + (row * N + i) * D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre[t, i] * streams[t, i] in float32, cast to streams.dtype: [T, D]."""
    t, n, d = streams.shape
    streams = streams.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _hc_collapse_kernel[(t, triton.cdiv(d, block))](streams, pre.float().contiguous(), out, d, N=n, BLOCK_D=block)
    return out


@triton.jit
def _hc_update_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D,
    N: tl.constexpr, ROUND_TERMS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    dtype = out_ptr.dtype.element_ty
    block_out = tl.load(o_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        post = tl.load(post_ptr + row * N + j)
        if ROUND_TERMS:  # V4: coefficients, the two terms and the sum each rounded to the streams' dtype
            post = post.to(dtype).to(tl.float32)
        mixed = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N):
            c = tl.load(comb_ptr + (row * N + i) * N + j)
            if ROUND_TERMS:
                c = c.to(dtype).to(tl.float32)
            mixed += c * tl.load(s_ptr + (row * N + i) * D + cols, mask=ok, other=0.0).to(tl.float32)
        scaled = post * block_out
        if ROUND_TERMS:
            scaled = scaled.to(dtype).to(tl.float32)
            mixed = mixed.to(dtype).to(tl.float32)
        tl.store(out_ptr + (row * N + j) * D + cols, (scaled + mixed).to(dtype), mask=ok)


def hc_update(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, round_terms: bool
) -> torch.Tensor:
    """out[t, j] = post[t, j]*block_out[t] + sum_i comb[t, i, j]*streams[t, i]: [T, n, D] streams.dtype.

    round_terms=True is V4's `hc_post` (coefficients cast to the streams' dtype, each term rounded),
    False is V4.1's `hc_expand` (float32 throughout, one rounding at the end).
    """
    t, n, d = streams.shape
    streams = streams.contiguous()
    out = torch.empty_like(streams)
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _hc_update_kernel[(t, triton.cdiv(d, block))](
            block_out.contiguous(), streams, post.float().contiguous(), comb.float().contiguous(), out, d,
            N=n, ROUND_TERMS=round_terms, BLOCK_D=block,
        )
    return out
