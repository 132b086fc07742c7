"""y = x @ W.T with W dense (bf16/fp32), fp8 e4m3 block-scaled or packed fp4 e2m1 (W8A16 / W4A16 / W8A8),
and its grouped form (the output projection's groups: each group's inputs meet its own rows of W), one launch.

The weight tile is dequantised in registers and meets x on the tensor cores in x.dtype with a float32
accumulator; fp8 block scales (powers of two) multiply each tile's partial product, which equals
scaling the weight exactly. Float32 inputs use IEEE float32 dots (the contract asks 1e-5, tf32 would
give ~3e-4). With `fp8_activations` an fp8 weight in K blocks of 64 or 128 columns meets x quantised to fp8
(`activation_quant`, one pass before the product) on the fp8 tensor cores; a K tile is one weight block and one
activation group, and each tile's product is a fresh float32 MMA result scaled and added to the accumulator, so no
long fp8 accumulation chain forms. Other K blocks (V4.1's 32) meet x rounded to its fp8 values in x's dtype on the
W8A16 tiles instead (`FP8_MMA_BLOCK_KS`). One row of x meeting an fp8 weight (W8A16, a decode step at batch 1), and a
few float32 rows meeting a dense weight, run on CUDA cores instead, a program a row (`one_row_tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.activation_quant import (
    activation_group_supported, fake_quantize_fp8_rows, quantize_fp8_rows, quantize_groups,
)
from deepinfer_kernels.arrival_counters import arrival_counters
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.dtype_names import dtype_name, triton_dtype
from deepinfer_kernels.weight_tiles import as_kernel_weight, e8m0_to_float, fp8_tiles, load_weight_tile, weight_format

__all__ = [
    "BATCH_INVARIANT_ROWS", "FP8_MMA_BLOCK_KS", "grouped_linear", "linear", "linear_supported", "one_row_tiles",
    "quantizes_in_epilogue", "split_k", "tile_config",
]

# Batch-invariant mode sizes every launch's tiles as for this many rows, whatever the row count: a
# row's K loop and MMA shapes are then the same in any batch (no config keyed on M, no split-K).
BATCH_INVARIANT_ROWS = 64
# Split-K launches have fewer output tiles than the GPU has multiprocessors: one arrival counter each.
_ARRIVAL_COUNTERS = 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split fill) of one row on CUDA cores (`one_row_tiles`): light programs,
# 4 a multiprocessor where K splits (H200: a fill of 4 beat 2 on most of the V4-Flash projections, BENCHMARKS.md).
ONE_ROW_TILE = (1, 64, 128, 4, 3, 4)
# Measured tiles of V4-Flash's fp8 projections (128 x 128 blocks, W8A16) at 2-64 rows, where the rule in `tile_config`
# left them at 15-60% of the copy rate: (BLOCK_M, weight rows, K) -> (BLOCK_N, warps, stages, split fill), BLOCK_K
# 128; an entry serves every row count of its row tile (2-16, 17-32, 33-64 rows). H100, graph replay over weight
# copies past L2 (scripts/tune_linear_tiles.py, BENCHMARKS.md), us at 16 / 32 / 64 rows, the rule's -> these: wq_a +
# wkv (one launch) 8.2 / - / 13.8 -> 6.7 / - / 11.1, the grouped wo_a 18.7 / 23.6 / 35.0 -> 17.6 / 20.2 / 26.4, wo_b
# 20.6 / 26.9 / 38.0 -> 17.8 / 20.8 / 27.0, wq_b 23.0 / - / 25.4 -> 16.8 / - / 20.8 (-: within about 5%, left to the
# rule). A 2-16 entry is the best sum over 8, 12 and 16 rows: wo_b's fastest at 16 rows (64 / 4 / 3 / 4, 17.5 us) took
# 23.7-24.1 at 4-12, 128 / 8 / 3 / 2 17.4-17.8 at 4-16. Wide K wants more K ranges or wider column tiles (fewer passes
# over x), the tall wq_b wider tiles at 64 rows and 8 warps at 16. With the 16- to 64-row tiles, the fp4-expert decode
# step (4 layers, context 4,096) went 2.213 -> 2.205 ms at batch 16 and 4.006 -> 3.935 at batch 64; the one 2-16
# bucket then took it from 1.994 to 1.981 ms at batch 12 and from 2.178 to 2.144 at batch 16.
FP8_DECODE_TILES = {
    (16, 1536, 4096): (32, 4, 3, 4), (16, 8192, 4096): (32, 4, 4, 1), (16, 4096, 8192): (128, 8, 3, 2),
    (16, 32768, 1024): (64, 8, 3, 2), (32, 8192, 4096): (64, 4, 4, 1), (32, 4096, 8192): (64, 4, 3, 4),
    (64, 1536, 4096): (32, 4, 4, 2), (64, 8192, 4096): (64, 4, 3, 1), (64, 4096, 8192): (128, 4, 3, 2),
    (64, 32768, 1024): (128, 4, 3, 2),
}
FLOAT32_ROW_TILES = 16
# Up to this many rows the MMA tiles are 64 rows tall (`tile_config`) for weights of up to TALL_WEIGHT_ROWS rows:
# 128-row tiles gave a small projection a handful of output tiles. H100, graph replay, 128 / 256 / 512 rows:
# V4.1's wq_a (1,280 x 5,120, fp8) 31.1 / 44.1 / 53.6 us -> 20.6 / 26.0 / 41.3, V4's wo_b (4,096 x 8,192, fp8)
# 61.5 / 103.6 / 157.5 -> 54.6 / 91.8 / 130.4; wq_b (32,768 rows) even to 8% faster (BENCHMARKS.md).
SIXTY_FOUR_ROW_TILES = 512
# A 64-row tile streams its columns of W once per 64 rows of x: L2 holds a projection's weight for the second
# pass, not the LM head's (129,280 x 4,096 bf16: 1.15 / 1.25 / 1.64x slower at 128 / 256 / 512 rows).
TALL_WEIGHT_ROWS = 65536
# Under fp8 activations, an fp8 weight of K blocks this wide meets x's fp8 codes on the fp8 MMAs (A8), a K tile a
# block. Other K blocks meet x rounded to its fp8 values in x's dtype (`fake_quantize_fp8_rows`) on the W8A16 tiles:
# the same W8A8 product (e4m3 values times powers of two are exact in bf16; the reference op's formula). H100, graph
# replay (BENCHMARKS.md): 32-column K tiles leave the fp8 MMAs too little work a scale, V4.1's wo_b (5,120 x 8,192,
# 32 x 32 blocks) 64.6 / 76.8 / 103.6 us at 1 / 16 / 64 rows on the A8 tiles against 21.9 / 22.8 / 47.5 so, wq_b
# 1.4-1.9x; in 64 x 64 blocks the A8 tiles are even at 1-16 rows and 1.2-1.4x faster at 64-512, in 128 x 128 even
# at 1 row and 1.35-2.5x faster at 2-512.
FP8_MMA_BLOCK_KS = (64, 128)
# Output tiles are visited in bands of this many row tiles, column tile after column tile within a band, so
# that the programs running at once share a band's rows of x and a few columns of W in L2 (`_tile_coords`),
# when a group's x is larger than X_IN_L2_BYTES (half an H100/H200's L2); a smaller x stays in L2 and is
# walked whole, column tile after column tile, each column of W read once (`_row_band`).
ROW_TILES_A_BAND = 8
X_IN_L2_BYTES = 24 << 20


@triton.jit
def _linear_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, ys_ptr, part_ptr, counter_ptr, M, N, K, K_PER_SPLIT, SPLITS, band,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_ym, stride_ysm, stride_ysplit,
    stride_xg, stride_xsg, stride_wg, stride_sg, stride_yg, stride_ysg,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
    VALUES: tl.constexpr, QUANT_OUT: tl.constexpr, PDL: tl.constexpr,
):
    """VALUES: the dtype (`dtype_names`) y's values are rounded to (x's, or that of the values x's codes encode);
    y stores them in its own dtype, or with QUANT_OUT (each column tile one quantisation group) as their fp8 codes,
    ys_ptr taking their scales."""
    wait_for_previous_grid(PDL)
    row_tiles, column_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), row_tiles, column_tiles, band)
    # axis 2: the group, then this program's K range (with several, each writes a float32 partial sum)
    group = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    x_ptr += group.to(tl.int64) * stride_xg
    xs_ptr += group.to(tl.int64) * stride_xsg
    w_ptr += group.to(tl.int64) * stride_wg
    s_ptr += group.to(tl.int64) * stride_sg
    y_ptr += group.to(tl.int64) * stride_yg
    ys_ptr += group.to(tl.int64) * stride_ysg
    part_ptr += group.to(tl.int64) * stride_yg
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_start, k_end = split * K_PER_SPLIT, tl.minimum(K, (split + 1) * K_PER_SPLIT)
    if BLOCK_M == 1:  # (`one_row_tiles`)
        acc = _one_row_sums(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, s_ptr, n0, k_start, k_end, N, K, stride_wn,
                            stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_N, BLOCK_K)
    else:
        acc = _mma_sums(x_ptr, xs_ptr, w_ptr, s_ptr, offs_m, n0, k_start, k_end, M, N, K, stride_xm, stride_xsm,
                        stride_wn, stride_sn, FORMAT, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, A8)
    cells = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLITS == 1:
        _store_output(acc, y_ptr + cells, ys_ptr, offs_m, pid_n, M, stride_ysm, mask, VALUES, QUANT_OUT)
    else:
        # The tile's last program to arrive adds the partial sums in split order (the same on every run)
        # and resets the tile's counter for the next launch: no reduction launch.
        tl.store(part_ptr + split.to(tl.int64) * stride_ysplit + cells, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = counter_ptr + (group * row_tiles + pid_m) * column_tiles + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLITS):
                # from L2 (.cg): this SM's L1 never holds another SM's partial
                total += tl.load(part_ptr + s * stride_ysplit + cells, mask=mask, other=0.0, cache_modifier=".cg")
            _store_output(total, y_ptr + cells, ys_ptr, offs_m, pid_n, M, stride_ysm, mask, VALUES, QUANT_OUT)
            tl.store(counter, 0)


@triton.jit
def _tile_coords(tile, row_tiles, column_tiles, band):
    """(row tile, column tile) of launch index `tile`: bands of `band` row tiles, each walked column by column
    (the band's row tiles of one column next to each other)."""
    band_tiles = band * column_tiles
    first_row = (tile // band_tiles) * band
    rows = tl.minimum(row_tiles - first_row, band)
    within = tile % band_tiles
    return first_row + within % rows, within // rows


@triton.jit
def _store_output(acc, y_cells, ys_ptr, offs_m, pid_n, M, stride_ysm, mask, VALUES: tl.constexpr,
                  QUANT_OUT: tl.constexpr):
    """The float32 sums rounded to VALUES, stored in y's dtype (a wider y, float32 logits, holds exactly what a y in
    VALUES would), or with QUANT_OUT as the tile's rows' fp8 codes (`quantize_fp8_rows`' bits) and scales."""
    values = acc.to(triton_dtype(VALUES))
    if QUANT_OUT:
        codes, scales = quantize_groups(values.to(tl.float32), 1)
        tl.store(ys_ptr + offs_m.to(tl.int64) * stride_ysm + pid_n, scales, mask=offs_m < M)
        values = codes
    tl.store(y_cells, values.to(y_cells.dtype.element_ty), mask=mask)


@triton.jit
def _mma_sums(
    x_ptr, xs_ptr, w_ptr, s_ptr, offs_m, n0, k_start, k_end, M, N, K, stride_xm, stride_xsm, stride_wn, stride_sn,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, A8: tl.constexpr,
):
    """x [BLOCK_M rows, K range] @ W^T [.., BLOCK_N] on the tensor cores, in float32; with A8, x_ptr holds fp8 codes
    and xs_ptr their per-row, per-K-tile scales."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    compute = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0,
        )
        w = load_weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, compute, BLOCK_K, SCALE_BN,
                             SCALE_BK)
        if A8:
            x_scale = tl.load(xs_ptr + offs_m.to(tl.int64) * stride_xsm + k0 // BLOCK_K, mask=offs_m < M, other=0.0)
            part = tl.dot(x, tl.trans(w)) * x_scale[:, None]
        elif IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))
        if FORMAT == 1:
            part = part * e8m0_to_float(tl.load(s_ptr + (n0 // SCALE_BN) * stride_sn + k0 // SCALE_BK))
        acc += part
    return acc


@triton.jit
def _one_row_sums(
    x_ptr, w_ptr, s_ptr, n0, k_start, k_end, N, K, stride_wn, stride_sn,
    FORMAT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """`_mma_sums` for one row of x (`one_row_tiles`), on CUDA cores in float32: each (column,
    k lane) keeps its own sum over the K tiles, added across the lanes once at the end, so the loop is a
    conversion and a fused multiply-add a weight, with no operand shuffles (the MMA pads x to 16 rows and
    gathers its fragments). A whole block's power-of-two scale (FP8) scales x instead, exactly."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        if FORMAT == 1:
            x = x * e8m0_to_float(tl.load(s_ptr + (n0 // SCALE_BN) * stride_sn + k0 // SCALE_BK))
        w = load_weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, tl.float32, BLOCK_K,
                             SCALE_BN, SCALE_BK)
        acc += w * x[None, :]
    return tl.sum(acc, axis=1)[None, :]


def tile_config(
    m: int, fmt: int, one_row: bool = False, weight_rows: int = 0, k: int = 0
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split fill) for m rows meeting a weight of `weight_rows`
    rows (all groups'); an fp8 weight's scale blocks then shape the tile (`weight_tiles.fp8_tiles`). A launch of
    fewer output tiles than multiprocessors splits K to fill `split fill` x them (`split_k`). `one_row`
    (`one_row_tiles`): the one-row tile on CUDA cores. `k`: K of a W8A16 launch that may split K, whose shapes in
    FP8_DECODE_TILES take their measured tile up to 64 rows (0: the rule's)."""
    if one_row:
        return ONE_ROW_TILE
    sixty_four = m <= 64 or (m <= SIXTY_FOUR_ROW_TILES and weight_rows <= TALL_WEIGHT_ROWS)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if sixty_four else 128
    measured = FP8_DECODE_TILES.get((block_m, weight_rows, k)) if fmt == 1 and m <= 64 else None
    if measured is not None:
        block_n, warps, stages, fill = measured
        return block_m, block_n, 128, warps, stages, fill
    block_n = 64 if m <= 64 else 128
    # decode-sized rows stream the weight: longer K tiles, one more stage (scripts/tune_linear_tiles.py:
    # the LM head at 1-16 rows goes from 95-97% to 100-102% of the measured copy bandwidth)
    block_k = 128 if fmt == 1 or m <= 16 else 64
    warps = 4 if block_m <= 64 else 8
    return block_m, block_n, block_k, warps, 4 if m <= 16 else 3, 2


def _row_band(row_tiles: int, x_bytes: int) -> int:
    """Row tiles a band of `_tile_coords`. On an H100 at 8,192 rows (BENCHMARKS.md), bands of 8 took wo_b
    (128 MB of x) from 1.122 to 1.037 ms and the grouped wo_a from 1.201 to 1.069, where whole columns had
    read all of x for every two columns of W; wq_b's 16 MB of x stayed in L2 either way and bands of 8 read
    its 64 MB of W eight times (1.106 -> 1.214 ms)."""
    return ROW_TILES_A_BAND if x_bytes > X_IN_L2_BYTES else max(row_tiles, 1)


def one_row_tiles(
    rows: int, fmt: int, block: tuple[int, int] | None, fp8_activations: bool, float32_x: bool = False
) -> bool:
    """Whether a launch takes `ONE_ROW_TILE` (`_one_row_sums`), a program a row:
    - one row of x meeting an fp8 weight whose scale blocks hold that tile (W8A16; V4's 128 x 128). On an H200 a
      CSA layer's five fp8 projections at one row took 58.2 us so against 70.0 on the MMA tiles; V4.1's 32 x 32
      blocks (a product more a weight), bf16 weights (the LM head 376 against 244 us), W8A8 and 2-4 rows
      measured slower so (BENCHMARKS.md);
    - up to FLOAT32_ROW_TILES float32 rows meeting a dense weight (V4.1's router and compressor at decode): the
      IEEE float32 MMA tiles are slow at few rows, and CUDA cores widen a bf16 weight as they load it."""
    if float32_x and fmt == 0:
        return rows <= FLOAT32_ROW_TILES
    if rows != 1 or fmt != 1 or fp8_activations:
        return False
    return fp8_tiles(block, ONE_ROW_TILE[1], ONE_ROW_TILE[2])[0] == 1


def split_k(tiles: int, k: int, block_k: int, num_sms: int, fill: int, one_row: bool = False) -> int:
    """How many K ranges to give a launch of `tiles` output tiles so that it fills `fill` x the GPU's
    multiprocessors (`tile_config`; 0: none): a decode step's projections have few output tiles (a 1024-wide
    projection at 16 rows is 16 programs). The partial sums add up in a fixed order (in the kernel), so the
    result is the same on every run. A range holds at least 4 K tiles (one-row tiles, light programs: 2)."""
    if tiles >= num_sms:
        return 1
    least_k_tiles, most = (2, 32) if one_row else (4, 16)
    return max(1, min(-(-fill * num_sms // tiles), k // (least_k_tiles * block_k), most))


def linear_supported(weight: torch.Tensor, block: tuple[int, int] | None, fp8_activations: bool = False) -> bool:
    """fp8 tiles must divide the scale block (powers of two >= 16), and with fp8 activations its K block must be
    a group of x the activation launches take (`activation_group_supported`); fp4 needs whole 32-column scale groups."""
    fmt = weight_format(weight)
    if fmt == 1:
        if fp8_activations and not activation_group_supported(block):
            return False
        return block is not None and all(b >= 16 and b & (b - 1) == 0 for b in block)
    if fmt == 2:
        return (weight.shape[1] * 2) % 32 == 0
    return True


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
    batch_invariant: bool = False, num_sms: int | None = None, fp8_activations: bool = False,
    out_dtype: torch.dtype | None = None, x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T. `num_sms`: the device's multiprocessors; given, launches with few output tiles split K
    (not in batch-invariant mode, whose K loop must not depend on the row count). `fp8_activations`:
    an fp8 weight meets x quantised to fp8 (W8A8); other weights ignore it. `out_dtype`: y's dtype (x's by
    default), holding the values rounded to x's dtype: linear(...).to(out_dtype) in the product's own pass.
    `x_scales` [..., K / block[1]]: x is fp8 codes (`grouped_linear`)."""
    k, n = x.shape[-1], weight.shape[0]
    if x_scales is not None:
        x_scales = x_scales.reshape(-1, 1, x_scales.shape[-1])
    y = grouped_linear(x.reshape(-1, 1, k), weight, scale, block, batch_invariant, num_sms, fp8_activations,
                       out_dtype, x_scales)
    return y.view(*x.shape[:-1], n)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
    batch_invariant: bool = False, num_sms: int | None = None, fp8_activations: bool = False,
    out_dtype: torch.dtype | None = None, x_scales: torch.Tensor | None = None, out_group: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, G, K], weight [G*N, K] -> y [T, G, N], y[:, g] = x[:, g] @ W[g*N:(g+1)*N].T, in one launch
    (arguments as in `linear`). fp8 groups hold whole scale blocks (N a multiple of block[0]). With `x_scales`
    [T, G, K / block[1]], x is already fp8 codes in the weight's K blocks (`quantize_fp8_rows` of values in
    out_dtype): the W8A8 launch without its quantisation, the same bits. With `out_group`, y is returned as the
    fp8 codes [T, G, N] and scales [T, G * N / out_group] of its values (`quantize_fp8_rows` of its rows of G * N,
    in groups of out_group columns), for a product that takes codes: the launch stores them where each of its
    column tiles is one group (`quantizes_in_epilogue`), else a quantisation launch follows."""
    tokens, groups, k = x.shape
    n, fmt = weight.shape[0] // groups, weight_format(weight)
    codes_given = x_scales is not None
    if codes_given and not (fmt == 1 and block[1] in FP8_MMA_BLOCK_KS and x.dtype == torch.float8_e4m3fn
                            and out_dtype is not None):
        raise ValueError(f"fp8 codes of x meet an fp8 weight of K blocks in {FP8_MMA_BLOCK_KS}, y in a given dtype")
    if fp8_activations and fmt == 1 and not activation_group_supported(block):
        raise ValueError(f"fp8 activations need an fp8 weight block of 16 to 256 columns (a power of two), not {block}")
    if fmt == 1 and groups > 1 and n % block[0]:
        raise ValueError(f"fp8 groups of {n} rows would split the weight's {block[0]}-row scale blocks")
    x = x if x.stride(-1) == 1 else x.contiguous()
    a8 = (fp8_activations or codes_given) and fmt == 1
    if a8 and block[1] not in FP8_MMA_BLOCK_KS:
        x, a8 = fake_quantize_fp8_rows(x.reshape(tokens * groups, k), block[1]).view(tokens, groups, k), False
    values = out_dtype if codes_given else x.dtype  # what x holds (or encodes)
    w, s = as_kernel_weight(weight.contiguous() if weight.stride(-1) != 1 else weight, scale)
    tiled_rows = BATCH_INVARIANT_ROWS if batch_invariant else tokens
    one_row = one_row_tiles(tiled_rows, fmt, block, a8, x.dtype == torch.float32)
    if fmt == 0 and w.dtype != x.dtype and not one_row:  # one-row tiles widen the weight as they load it
        w = w.to(x.dtype)
    measured_k = 0 if a8 or batch_invariant else k  # (FP8_DECODE_TILES: W8A16 launches that split K)
    block_m, block_n, block_k, warps, stages, fill = tile_config(tiled_rows, fmt, one_row, weight.shape[0], measured_k)
    kernel_format = fmt
    if fmt == 1 and not a8:
        kernel_format, block_n, block_k = fp8_tiles(block, block_n, block_k)
    if a8 and (out_dtype or values) != values:
        raise ValueError(f"fp8 activations give y in x's dtype ({values}), not {out_dtype}")
    x_in = x
    if a8:
        block_n, block_k = min(block_n, block[0]), block[1]  # one K tile = one activation group
        if codes_given:
            x_scales = x_scales.contiguous()
        else:
            codes, x_scales = quantize_fp8_rows(x.reshape(tokens * groups, k), block_k)
            x_in, x_scales = codes.view(tokens, groups, k), x_scales.view(tokens, groups, -1)
    else:
        x_scales = w  # never read
    quant_out = out_group is not None and quantizes_in_epilogue(out_group, block_n, n)
    out = torch.empty((tokens, groups, n), dtype=torch.float8_e4m3fn if quant_out else out_dtype or values,
                      device=x.device)
    # (out_scales is out where there are no scales to store: never read then)
    out_scales = out.new_empty((tokens, groups * n // out_group), dtype=torch.float32) if quant_out else out
    scale_bn, scale_bk = block if fmt == 1 else (1, 1)
    scale_rows_per_group = n // scale_bn
    tiles = (triton.cdiv(tokens, block_m), triton.cdiv(n, block_n))
    splits = 1
    if not batch_invariant and num_sms is not None:
        splits = split_k(tiles[0] * tiles[1] * groups, k, block_k, num_sms, fill, one_row)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    partials, counters = out, out  # never read with one split
    if splits > 1:
        partials = torch.empty((splits, tokens, groups, n), dtype=torch.float32, device=x.device)
        counters = _arrival_counters(x.device, tiles[0] * tiles[1] * groups)
    s_stride = s.stride(0) if scale is not None else 0
    _linear_kernel[(tiles[0] * tiles[1], 1, groups * splits)](
        x_in, x_scales, w, s, out, out_scales, partials, counters, tokens, n, k, k_per_split, splits,
        _row_band(tiles[0], tokens * k * x_in.element_size()),
        x_in.stride(0), x_scales.stride(0), w.stride(0), s_stride, out.stride(0),
        out_scales.stride(0) if quant_out else 0, partials.stride(0),
        x_in.stride(1), x_scales.stride(1) if a8 else 0, n * w.stride(0), scale_rows_per_group * s_stride,
        out.stride(1), n // block_n if quant_out else 0,
        FORMAT=kernel_format, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        A8=a8, VALUES=dtype_name(values), QUANT_OUT=quant_out, num_warps=warps, num_stages=stages,
        **launch_options(x.device),
    )
    if out_group is None:
        return out
    if quant_out:
        return out, out_scales
    codes, scales = quantize_fp8_rows(out.view(tokens, groups * n), out_group)
    return codes.view(tokens, groups, n), scales


def quantizes_in_epilogue(group: int, block_n: int, n: int) -> bool:
    """Whether `grouped_linear`'s launch stores y as fp8 codes in groups of `group` columns: when each of its
    column tiles (block_n wide, of a group's N columns) is exactly one quantisation group, as the W8A8 prefill
    tiles of 128 x 128 blocks are (V4's wo_a for wo_b). The same codes as the quantisation launch's. H100, V4's
    wo_a then wo_b at 8,192 rows: wo_a 1,031.5 -> 1,053.0 us, wo_b 580.6 -> 497.7 (no quantisation launch), the
    pair 1,633.9 -> 1,574.1 (BENCHMARKS.md)."""
    return block_n == group and n % block_n == 0


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's split-K arrival counters (`arrival_counters`)."""
    if tiles > _ARRIVAL_COUNTERS:
        raise ValueError(f"a split-K launch of {tiles} output tiles exceeds the {_ARRIVAL_COUNTERS} arrival counters")
    return arrival_counters("split-K", device, _ARRIVAL_COUNTERS)
