"""Hyper-connection (mHC) kernels: the mixing coefficients with their Sinkhorn normalisation in one
pass over the streams, the collapse to a block input, and the stream update after a block, alone or with
the next site's coefficients in the same pass.

Every program owns whole rows (tokens) and reduces in a fixed order, so a row's result never depends
on the other rows of the batch (batch-invariant by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = [
    "fn_pieces", "hc_collapse", "hc_head_weights", "hc_mix", "hc_update", "hc_update_mix", "takes_fn_pieces",
    "tile_config", "update_mix_tiles",
]


# Steps of up to this many rows take the decode-sized tiles (`tile_config`).
_DECODE_ROWS = 64
# Columns of fn a program of `fn_pieces` splits.
_PIECE_COLUMNS = 1024


def tile_config(tokens: int, batch_invariant: bool) -> tuple[int, int, int, int]:
    """(CHUNK, BLOCK_K, BLOCK_T, warps) of the partial launch: the K reduction is split into CHUNK-column
    chunks, reduced afterwards in a fixed order. Prefill-sized steps and the batch-invariant mode use
    1024-column chunks (the same order for every batch); decode-sized steps 128-column ones, so that one
    row still spreads over the GPU (16 programs at V4-Flash width otherwise). From
    `scripts/tune_hc_tiles.py` on an H200 (BENCHMARKS.md): both launches at 1 / 64 rows 17.7 / 23.2 us
    with 256-column chunks, 14.2 / 17.9 us with these."""
    if batch_invariant:
        return 1024, 64, 16, 4
    if tokens <= _DECODE_ROWS:
        return 128, 32, 16, 2
    return 1024, 64, 64, 4


def update_mix_tiles(tokens: int, n: int, batch_invariant: bool) -> tuple[int, int, int, int]:
    """(COLUMNS, BLOCK_D, BLOCK_T, warps) of `hc_update_mix`'s partial launch: `tile_config`'s rows and warps;
    each program takes COLUMNS columns of D in all n streams, `hc_mix`'s chunk of flat columns over n (rounded up
    to a power of two, so that COLUMNS is one and BLOCK_D divides it), in steps of BLOCK_D: 64 in the prefill
    tile (64 rows), 32 else. H100, V4 widths, 8,192 tokens: 440 us in steps of 32, 375 in steps of 64 (as
    `hc_update` then `hc_mix`, 373); 4 / 8 warps, 32 / 64 / 128 rows, 128 to 1,024 columns no better than 2%
    (BENCHMARKS.md). The batch-invariant mode's 16 rows take 32 whatever the step."""
    chunk, _, block_t, warps = tile_config(tokens, batch_invariant)
    block_d = 64 if block_t == 64 else 32
    return max(block_d, chunk // triton.next_power_of_2(n)), block_d, block_t, warps


@triton.jit
def _hc_mix_partial_kernel(
    x_ptr, fn_ptr, part_ptr, T, K, FN_ROWS,
    FNP: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # Partial dot products of one K chunk with every row of fn in one product (pre | post | comb rows,
    # padded to FNP >= 16 columns), and the sum of squares: part[chunk, t] = [fn @ x (FNP) | sum x^2].
    chunk, rows, row_ok, fn_rows, acc, squares = _partial_tile(T, BLOCK_T, FNP)
    for k0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # fn split in the loop: `fn_pieces` loaded here (4 warps) gave sums that changed with the pipeline's stage
        # count and from run to run (H100 / H200, BENCHMARKS.md), which `hc_update_mix`'s launch never showed
        acc, squares = _mix_partial(x, fn_ptr, fn_ptr, fn_rows, FN_ROWS, ks, k_ok, K, acc, squares, SPLIT_BF16, False)
    _store_partials(part_ptr, chunk, T, rows, row_ok, acc, squares, FNP, WIDTH)


@triton.jit
def _partial_tile(T, BLOCK_T: tl.constexpr, FNP: tl.constexpr):
    """A partial-sum program's (chunk, rows, rows < T, fn's padded rows, zero products [BLOCK_T, FNP], zero sums of
    squares [BLOCK_T])."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    return (tl.program_id(1), rows, rows < T, tl.arange(0, FNP), tl.zeros([BLOCK_T, FNP], dtype=tl.float32),
            tl.zeros([BLOCK_T], dtype=tl.float32))


@triton.jit
def _mix_partial(x, fn_ptr, pieces_ptr, fn_rows, FN_ROWS, ks, k_ok, K, acc, squares, SPLIT_BF16: tl.constexpr,
                 PIECES: tl.constexpr):
    """(acc + x @ w, squares + the rows' sums of x^2) in float32: x [BLOCK_T, BLOCK_K] in the streams' dtype, w fn's
    [BLOCK_K, FNP] tile at columns ks of its rows of K (zero past them and past fn's rows); with PIECES its bf16
    pieces from `fn_pieces`' planes at pieces_ptr instead of fn's float32."""
    if SPLIT_BF16:
        # bf16 streams meet fn as three bf16 pieces, hi + mid + lo = fn (each residual is exact in
        # float32): exact products, float32 sums, on bf16 tensor cores. 3xTF32 splits every element of
        # x instead: 0.13 of the copy bandwidth at 8,192 rows against 0.34 (BENCHMARKS.md).
        if PIECES:
            at = pieces_ptr + fn_rows[None, :] * K + ks[:, None]
            plane = fn_rows.shape[0] * K
            hi = tl.load(at, mask=k_ok[:, None], other=0.0)
            mid = tl.load(at + plane, mask=k_ok[:, None], other=0.0)
            lo = tl.load(at + 2 * plane, mask=k_ok[:, None], other=0.0)
        else:
            hi, mid, lo = _bf16_pieces(_fn_tile(fn_ptr, fn_rows, FN_ROWS, ks, k_ok, K))
        acc = tl.dot(x, hi, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, lo, acc)
        x = x.to(tl.float32)
    else:
        x = x.to(tl.float32)
        acc = tl.dot(x, _fn_tile(fn_ptr, fn_rows, FN_ROWS, ks, k_ok, K), acc, input_precision="tf32x3")
    return acc, squares + tl.sum(x * x, axis=1)


@triton.jit
def _fn_tile(fn_ptr, fn_rows, FN_ROWS, ks, k_ok, K):
    """fn's float32 [BLOCK_K, FNP] tile: columns ks of its rows fn_rows (of K columns), zero past them and past
    fn's FN_ROWS rows."""
    return tl.load(fn_ptr + fn_rows[None, :] * K + ks[:, None], mask=(fn_rows < FN_ROWS)[None, :] & k_ok[:, None],
                   other=0.0)


@triton.jit
def _bf16_pieces(w):
    """float32 w as bf16 (hi, mid, lo), hi + mid + lo = w exactly (each residual is exact in float32)."""
    hi = w.to(tl.bfloat16)
    rest = w - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _fn_pieces_kernel(fn_ptr, out_ptr, FN_ROWS, K, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """`fn_pieces`: a program per padded row of fn and BLOCK columns."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < K
    hi, mid, lo = _bf16_pieces(tl.load(fn_ptr + row * K + cols, mask=ok & (row < FN_ROWS), other=0.0))
    at = out_ptr + row * K + cols
    plane = tl.num_programs(0) * K
    tl.store(at, hi, mask=ok)
    tl.store(at + plane, mid, mask=ok)
    tl.store(at + 2 * plane, lo, mask=ok)


def fn_pieces(fn: torch.Tensor, fnp: int) -> torch.Tensor:
    """fn [R, K] float32 as its three bf16 pieces (`_bf16_pieces`), planes [3, fnp, K] (rows past R zero), for
    `hc_update_mix`'s partial launch to load instead of splitting fn in every K step: V4 widths, 8,192 tokens, the
    same bits, the op 377 -> 346 us on an H100 (BENCHMARKS.md)."""
    rows, k = fn.shape
    out = torch.empty(3, fnp, k, dtype=torch.bfloat16, device=fn.device)
    _fn_pieces_kernel[(fnp, triton.cdiv(k, _PIECE_COLUMNS))](
        fn, out, rows, k, BLOCK=_PIECE_COLUMNS, **launch_options(fn.device)
    )
    return out


@triton.jit
def _store_partials(part_ptr, chunk, T, rows, row_ok, acc, squares, FNP: tl.constexpr, WIDTH: tl.constexpr):
    """part[chunk, rows] = [acc (FNP) | squares], the layout `_hc_mix_epilogue_kernel` reads."""
    out = part_ptr + (chunk * T + rows.to(tl.int64)) * WIDTH
    tl.store(out[:, None] + tl.arange(0, FNP)[None, :], acc, mask=row_ok[:, None])
    tl.store(out + FNP, squares, mask=row_ok)


def _epilogue_warps(tile: int) -> int:
    """Warps of the one-row epilogue over a `tile` of partial sums: one for a prefill-sized step's small
    tile (more programs resident to hide the Sinkhorn's latency), up to four so that a decode-sized
    step's tile of many chunks stays in registers."""
    return max(1, min(4, tile // 1024))


@triton.jit
def _hc_mix_epilogue_kernel(
    part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, CHUNKS, norm_eps, hc_eps,
    N: tl.constexpr, NP: tl.constexpr, PN: tl.constexpr, FNP: tl.constexpr, WIDTH: tl.constexpr,
    ITERS: tl.constexpr, PRE_ONLY: tl.constexpr, CHUNKS_P2: tl.constexpr, WIDTH_P2: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # One row: all its chunks' partial sums in one load, reduced in one tree (the same for every row).
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_P2)
    cols = tl.arange(0, WIDTH_P2)
    parts = tl.load(part_ptr + (chunks[:, None] * T + row) * WIDTH + cols[None, :],
                    mask=(chunks[:, None] < CHUNKS) & (cols[None, :] < WIDTH), other=0.0)
    sums = tl.sum(parts, axis=0)  # pre (N) | post (N) | comb (N*N) | padding | sum x^2 (column FNP)
    # The sums go to this row's chunk-0 partials (read above, and by no other program) and come back as the
    # vectors and the [NP, NP] tile they hold: loaded, each takes a layout of its own, whole in every warp, so
    # that picking them needs no reduction and the Sinkhorn's 2 * ITERS reductions stay inside warps. Spread
    # over the warps like the partials they came from, each pick and sum was a barrier and a shared-memory
    # round trip (83 barriers a launch).
    own = part_ptr + row * WIDTH
    tl.store(own + cols, sums, mask=cols < WIDTH)
    tl.debug_barrier()
    cols_pn = tl.arange(0, PN)
    pn_ok = cols_pn < N
    r2 = tl.arange(0, NP)[:, None]
    c2 = tl.arange(0, NP)[None, :]
    ok2 = (r2 < N) & (c2 < N)
    # fn @ (x * r) == r * (fn @ x): the RMS factor is applied once, after the reduction.
    r = tl.rsqrt(tl.load(own + FNP) / K + norm_eps)
    pre = tl.sigmoid(tl.load(own + cols_pn, mask=pn_ok, other=0.0) * r * tl.load(scale_ptr)
                     + tl.load(base_ptr + cols_pn, mask=pn_ok, other=0.0))
    tl.store(pre_ptr + row * N + cols_pn, pre + hc_eps, mask=pn_ok)
    if PRE_ONLY:
        return
    post = 2.0 * tl.sigmoid(tl.load(own + N + cols_pn, mask=pn_ok, other=0.0) * r * tl.load(scale_ptr + 1)
                            + tl.load(base_ptr + N + cols_pn, mask=pn_ok, other=0.0))
    tl.store(post_ptr + row * N + cols_pn, post, mask=pn_ok)
    logits = (tl.load(own + 2 * N + r2 * N + c2, mask=ok2, other=0.0) * r * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + 2 * N + r2 * N + c2, mask=ok2, other=0.0))
    logits = tl.where(ok2, logits, tl.where(r2 < N, float("-inf"), 0.0))
    logits = logits - tl.max(logits, axis=1)[:, None]
    e = tl.exp(logits)
    comb = tl.where(ok2, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + row * (N * N) + r2 * N + c2, comb, mask=ok2)


def hc_mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int, batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) float32 of `KernelOps.hc_mix`, one pass over the streams.

    The dot products are float32-accurate on tensor cores: bf16 streams against fn split into three bf16
    pieces, float32 streams as 3xTF32. batch_invariant fixes the row tile (otherwise 64 rows for
    prefill-sized steps, 16 for decode-sized ones).
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
    k = n * d
    fnp, width = _partials_width(fn)
    chunk, block_k, block_t, warps = tile_config(t, batch_invariant)
    parts = torch.empty(triton.cdiv(k, chunk), t, width, dtype=torch.float32, device=streams.device)
    if t:
        _hc_mix_partial_kernel[(triton.cdiv(t, block_t), parts.shape[0])](
            x, fn.float().contiguous(), parts, t, k, fn.shape[0],
            FNP=fnp, WIDTH=width, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=block_k,
            SPLIT_BF16=x.dtype == torch.bfloat16, num_warps=warps, **launch_options(x.device),
        )
    return _coefficients(parts, n, d, base, scale, norm_eps, hc_eps, sinkhorn_iters, pre_only)


def takes_fn_pieces(tokens: int, dtype: torch.dtype, batch_invariant: bool) -> bool:
    """Whether `hc_update_mix`'s partial launch loads fn's `fn_pieces` rather than splitting fn in its K loop: bf16
    streams in prefill-sized steps do; decode-sized ones (the pieces' launch would add a boundary to a latency-bound
    step) and batch-invariant mode (whose one tile serves every batch, so a row meets the same instructions in each)
    do not."""
    return dtype == torch.bfloat16 and not batch_invariant and tokens > _DECODE_ROWS


def _partials_width(fn: torch.Tensor) -> tuple[int, int]:
    """(FNP, WIDTH) of the partial sums: fn's rows padded to a legal dot width (>= 16), then the sum of squares."""
    fnp = max(16, triton.next_power_of_2(fn.shape[0]))
    return fnp, fnp + 1


def _coefficients(parts, n, d, base, scale, norm_eps, hc_eps, sinkhorn_iters, pre_only):
    """(pre, post, comb) from the partial sums parts [chunks, T, WIDTH] of the flat rows of n * d columns."""
    chunks, t, width = parts.shape
    pre = torch.empty(t, n, dtype=torch.float32, device=parts.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=parts.device)
    if t == 0:
        return pre, post, comb
    # NP: n padded to a power of two >= 4 (the comb tile [NP, NP]); PN: the pre / post vectors' width
    np_, pn = max(4, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(n))
    chunks_p2, width_p2 = triton.next_power_of_2(chunks), triton.next_power_of_2(width)
    _hc_mix_epilogue_kernel[(t,)](
        parts, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, n * d, chunks,
        norm_eps, hc_eps, N=n, NP=np_, PN=pn, FNP=width - 1, WIDTH=width, ITERS=sinkhorn_iters, PRE_ONLY=pre_only,
        CHUNKS_P2=chunks_p2, WIDTH_P2=width_p2, num_warps=_epilogue_warps(chunks_p2 * width_p2),
        **launch_options(parts.device),
    )
    return pre, post, comb


@triton.jit
def _hc_collapse_kernel(s_ptr, pre_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(out_ptr + row * D + cols, _collapse(s_ptr, pre_ptr, row, cols, D, N).to(out_ptr.dtype.element_ty),
             mask=cols < D)


@triton.jit
def _hc_collapse_norm_kernel(
    s_ptr, pre_ptr, w_ptr, out_ptr, D, eps, N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # A whole row a program: the collapse rounded to the streams' dtype, then `rms_norm`'s arithmetic on it.
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = _collapse(s_ptr, pre_ptr, row, cols, D, N).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _collapse(s_ptr, pre_ptr, row, cols, D, N: tl.constexpr):
    """sum_i pre[row, i] * streams[row, i, cols] in float32 (zero past D)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for i in tl.static_range(N):
        w = tl.load(pre_ptr + row * N + i)
        acc += w * tl.load(s_ptr + (row * N + i) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    return acc


def hc_collapse(
    streams: torch.Tensor, pre: torch.Tensor, input_norm: tuple[torch.Tensor, float] | None = None
) -> torch.Tensor:
    """sum_i pre[t, i] * streams[t, i] in float32, cast to streams.dtype: [T, D]. With `input_norm` (weight,
    eps), the block's input norm too (`KernelOps.hc_pre_norm`): one launch, a row a program, in place of the
    collapse and `rms_norm`'s two passes over [T, D]."""
    t, n, d = streams.shape
    streams = streams.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if not t:
        return out
    pre = pre.float().contiguous()
    if input_norm is not None:
        block = triton.next_power_of_2(d)
        weight, eps = input_norm
        # as `rms_norm`: 8 warps past 2k columns keep a whole row in registers
        _hc_collapse_norm_kernel[(t,)](
            streams, pre, weight, out, d, eps, N=n, BLOCK_D=block, num_warps=8 if block >= 2048 else 4,
            **launch_options(streams.device),
        )
        return out
    block = min(1024, triton.next_power_of_2(d))
    _hc_collapse_kernel[(t, triton.cdiv(d, block))](
        streams, pre, out, d, N=n, BLOCK_D=block, **launch_options(streams.device)
    )
    return out


@triton.jit
def _hc_update_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D,
    N: tl.constexpr, ROUND_TERMS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    block_out = tl.load(o_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        _update_stream(block_out, s_ptr, post_ptr, comb_ptr, out_ptr, row, cols, ok, D, j, N, ROUND_TERMS)


@triton.jit
def _update_stream(
    block_out, s_ptr, post_ptr, comb_ptr, out_ptr, rows, cols, ok, D, j, N: tl.constexpr, ROUND_TERMS: tl.constexpr,
):
    """Stores new stream j at (rows, cols) (masked by `ok`) and returns it, in the streams' dtype: post[j] *
    block_out + sum_i comb[i, j] * streams[i]. rows: a row, or a column of them, all in range (their
    coefficients load unmasked); block_out float32, zero where not `ok`."""
    dtype = out_ptr.dtype.element_ty
    post = tl.load(post_ptr + rows * N + j)
    if ROUND_TERMS:  # V4: coefficients, the two terms and the sum each rounded to the streams' dtype
        post = post.to(dtype).to(tl.float32)
    mixed = tl.zeros_like(block_out)
    for i in tl.static_range(N):
        c = tl.load(comb_ptr + (rows * N + i) * N + j)
        if ROUND_TERMS:
            c = c.to(dtype).to(tl.float32)
        mixed += c * tl.load(s_ptr + (rows * N + i) * D + cols, mask=ok, other=0.0).to(tl.float32)
    scaled = post * block_out
    if ROUND_TERMS:
        scaled = scaled.to(dtype).to(tl.float32)
        mixed = mixed.to(dtype).to(tl.float32)
    new = (scaled + mixed).to(dtype)
    tl.store(out_ptr + (rows * N + j) * D + cols, new, mask=ok)
    return new


@triton.jit
def _hc_update_mix_partial_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, pieces_ptr, part_ptr, T, D, FN_ROWS,
    N: tl.constexpr, FNP: tl.constexpr, WIDTH: tl.constexpr, COLUMNS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BF16: tl.constexpr, PIECES: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    # `_hc_update_kernel`'s new streams (V4's `hc_post`: each term rounded) for columns [chunk * COLUMNS,
    # + COLUMNS) of all N streams, and from them, as stored (in the streams' dtype), `_hc_mix_partial_kernel`'s
    # partial sums over those flat columns (j * D + col): the new streams go to memory once and are never read back.
    chunk, rows, row_ok, fn_rows, acc, squares = _partial_tile(T, BLOCK_T, FNP)
    # rows past T take row T - 1's coefficients: their streams load as zeros and none of theirs is stored
    row_col, row_col_ok = tl.minimum(rows, T - 1).to(tl.int64)[:, None], row_ok[:, None]
    for d0 in range(chunk * COLUMNS, tl.minimum(chunk * COLUMNS + COLUMNS, D), BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        ok = row_col_ok & col_ok[None, :]
        block_out = tl.load(o_ptr + row_col * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        # a loop over the streams, not unrolled: unrolled, the compiler keeps all N steps' loads in flight
        # (255 registers and spills at the prefill tile, `scripts/compile_kernels.py`)
        for j in range(N):
            x = _update_stream(block_out, s_ptr, post_ptr, comb_ptr, out_ptr, row_col, cols[None, :], ok, D, j, N, True)
            acc, squares = _mix_partial(x, fn_ptr, pieces_ptr, fn_rows, FN_ROWS, j * D + cols, col_ok, N * D, acc,
                                        squares, SPLIT_BF16, PIECES)
    _store_partials(part_ptr, chunk, T, rows, row_ok, acc, squares, FNP, WIDTH)


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
            N=n, ROUND_TERMS=round_terms, BLOCK_D=block, **launch_options(streams.device),
        )
    return out


def hc_update_mix(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
    base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """V4's `hc_update` (round_terms, `hc_post`) then `hc_mix` of the new streams (`KernelOps.hc_update_mix`) in two
    launches, where they took three, and one pass over the streams: (new streams [T, n, D] streams.dtype, pre, post,
    comb float32).

    The new streams are bitwise `hc_update`'s. The partial sums group the flat columns by columns of D across
    the n streams, not in `hc_mix`'s flat chunks: the coefficients differ from `hc_mix`'s in the float32
    summation order only (~1e-7), still an order fixed by the shapes, so rows stay batch-invariant.
    """
    t, n, d = streams.shape
    streams = streams.contiguous()
    out = torch.empty_like(streams)
    fnp, width = _partials_width(fn)
    columns, block_d, block_t, warps = update_mix_tiles(t, n, batch_invariant)
    parts = torch.empty(triton.cdiv(d, columns), t, width, dtype=torch.float32, device=streams.device)
    if t:
        fn = fn.float().contiguous()
        pieces = takes_fn_pieces(t, out.dtype, batch_invariant)
        _hc_update_mix_partial_kernel[(triton.cdiv(t, block_t), parts.shape[0])](
            block_out.contiguous(), streams, post.float().contiguous(), comb.float().contiguous(), out,
            fn, fn_pieces(fn, fnp) if pieces else fn, parts, t, d, fn.shape[0], N=n, FNP=fnp, WIDTH=width,
            COLUMNS=columns, BLOCK_T=block_t, BLOCK_D=block_d, SPLIT_BF16=out.dtype == torch.bfloat16,
            PIECES=pieces, num_warps=warps, **launch_options(out.device),
        )
    return out, *_coefficients(parts, n, d, base, scale, norm_eps, hc_eps, sinkhorn_iters, pre_only=False)
