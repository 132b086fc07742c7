"""Loading one [BLOCK_N, BLOCK_K] tile of a projection weight in any of the release's formats.

Formats (MODEL_SPEC §8, `deepinfer_core.quantization`), the kernels' FORMAT constexpr in brackets:
- DENSE (0): the weight in the compute dtype.
- FP8 (1): float8_e4m3fn values; the (bn x bk) block scale is a power of two, so the caller multiplies the
  tile's partial product by it (exact) instead of scaling every element: tiles never straddle a block.
  FP8_SCALED_TILES (4): the same weights in tiles of whole blocks smaller than the tile (DeepSeek-V4.1's
  32 x 32): each weight times its block's scale here (exact in the compute dtype), so that a decode-sized
  launch keeps tiles long enough to stream the weight (`fp8_tiles`).
- FP4 (2): e2m1 codes, two per byte (even column in the low nibble), one e8m0 scale per 32 columns, applied
  here per 32-column group, in two exact products per weight. FP4_SMALL_SCALES (3): the same codes whose
  scales are all at most 2 (`fp4_scales_small`, every real checkpoint's): one product per weight, 10-12%
  faster at decode sizes. The kernels read the codes as int32 words (eight codes) and decode two codes
  per integer op into float32 bits (`e2m1_words_as_float`): no lookup table, no sm_90-only instruction, so
  the same code runs on SM100. FP4_PAIR_ORDER (5): the same codes as FP4_SMALL_SCALES, decoded in inline
  PTX two codes per instruction all the way to bfloat16 (`_fp4_pair_tile`, 17 instructions for eight
  weights) into a tile whose columns come in pair order (`pair_order`); the caller puts its activations in
  the same order (the MoE's decode-sized launches). Triton's `tl.dot_scaled` (the native fp4 MMA on SM100)
  was measured on the H200: as fast at decode sizes, 1.6x slower at prefill, and the CPU interpreter the
  tests run through lacks it (BENCHMARKS.md).

Scales arrive as raw uint8 e8m0 bytes (value 2^(byte - 127)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = [
    "FP4_PAIR_ORDER", "FP4_SMALL_SCALES", "FP8_SCALED_TILES", "as_kernel_weight", "decoded_weight",
    "e2m1_words_as_float", "e8m0_to_float", "fp4_scales_small", "fp8_tiles", "load_weight_tile", "pair_order",
    "pair_order_columns", "weight_format",
]

FP4_SMALL_SCALES = 3
FP8_SCALED_TILES = 4
FP4_PAIR_ORDER = 5


def weight_format(weight: torch.Tensor) -> int:
    """The FORMAT constexpr of the kernels: 0 dense, 1 fp8 e4m3 block-scaled, 2 packed fp4 e2m1."""
    if weight.dtype == torch.float8_e4m3fn:
        return 1
    if weight.dtype == torch.int8:
        return 2
    return 0


def fp4_scales_small(*scales: torch.Tensor) -> bool:
    """Every e8m0 scale byte is at most 128 (scale <= 2), so FP4_SMALL_SCALES applies. Reads the scales'
    maximum back to the host (a synchronisation): decide once per weight, not per step."""
    return all(int(s.view(torch.uint8).max()) <= 128 for s in scales if s.numel())


def fp8_tiles(block: tuple[int, int], block_n: int, block_k: int) -> tuple[int, int, int]:
    """(FORMAT, BLOCK_N, BLOCK_K) for an fp8 weight of scale `block` under the wanted tile: FP8 when the tile
    fits in a block; FP8_SCALED_TILES when it holds whole blocks; else FP8 in tiles shrunk to the block."""
    if block[0] >= block_n and block[1] >= block_k:
        return 1, block_n, block_k
    if block_n % block[0] == 0 and block_k % block[1] == 0:
        return FP8_SCALED_TILES, block_n, block_k
    return 1, min(block_n, block[0]), min(block_k, block[1])


def as_kernel_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale bytes) as the kernels read them: packed fp4 as int32 words of eight codes (rows of whole
    32-column scale groups, so always whole words), e8m0 scales as uint8."""
    if weight.dtype == torch.int8:
        weight = weight.view(torch.int32)
    scale_bytes = scale.view(torch.uint8) if scale is not None else weight
    return weight, scale_bytes


@triton.jit
def e8m0_to_float(byte):
    return tl.exp2(byte.to(tl.float32) - 127.0)


@triton.jit
def e2m1_words_as_float(words):
    """[R, W] int32 words of eight e2m1 codes (byte j: code 2j in the low nibble, 2j+1 in the high) as
    float32 [R, W // 4, 32], in column order, each equal to its code's value * 2^-126.

    Two codes per integer op: each word yields four int32 holding the bfloat16 bits of codes (k, k+4),
    the three magnitude bits placed in the exponent's two lowest bits and the mantissa's top bit. A
    bfloat16's bits are the top half of the float32 of equal value, so one shift or mask gives each
    float. The exponent-0 codes (0, 0.5) come out as float32 subnormals (0.5 -> 2^-127): no case needs a
    select. With the one-product scale, the MoE's decode loop takes 6.7 instructions per weight, against
    11.2 for the earlier float16-bit decode of one byte at a time (BENCHMARKS.md)."""
    pair0 = ((words & 0x00070007) << 6) | ((words & 0x00080008) << 12)  # codes 0, 4: low nibbles of bytes 0, 2
    pair1 = ((words & 0x00700070) << 2) | ((words & 0x00800080) << 8)  # 1, 5: their high nibbles
    pair2 = ((words >> 2) & 0x01C001C0) | ((words << 4) & -2147450880)  # 2, 6: low nibbles of bytes 1, 3
    pair3 = ((words >> 6) & 0x01C001C0) | (words & -2147450880)  # 3, 7 (-2147450880: sign bits 0x80008000)
    pairs = tl.reshape(tl.join(tl.join(pair0, pair2), tl.join(pair1, pair3)), [words.shape[0], words.shape[1], 4])
    low = (pairs << 16).to(tl.float32, bitcast=True)  # codes 0..3
    high = (pairs & -65536).to(tl.float32, bitcast=True)  # codes 4..7 (-65536: 0xFFFF0000)
    values = tl.permute(tl.join(low, high), (0, 1, 3, 2))  # [R, W, 4, 2] -> [R, W, 2, 4]: code order
    return tl.reshape(values, [words.shape[0], words.shape[1] // 4, 32])


@triton.jit
def pair_order(tile):
    """The columns of a [R, C] tile (C a multiple of 8) in pair order: within each 8, columns 0, 4, 1, 5, 2, 6,
    3, 7. An FP4_PAIR_ORDER weight tile comes so, as one integer op decodes codes k and k + 4 of a word into
    the two halves of one register, which the MMA then takes as neighbours; the activations, put in the
    same order, leave the dot product unchanged and cost a byte permute per two of them, not per two
    weights (the MMA's other operand is the weights' 8 or 16 rows: many weights per activation)."""
    rows: tl.constexpr = tile.shape[0]
    cols: tl.constexpr = tile.shape[1]
    return tl.reshape(tl.permute(tl.reshape(tile, [rows, cols // 8, 2, 4]), (0, 1, 3, 2)), [rows, cols])


# Inline PTX for FP4_PAIR_ORDER; Triton's interpreter runs no PTX, so there the float32 decode computes
# the very same tile (each step is exact either way) and `pair_order` reorders it.
_PTX_DECODE = tl.constexpr(not triton.knobs.runtime.interpret)

# One int32 word of eight codes ($8) and a bfloat16x2 scale ($9) -> the eight weights as bfloat16 bits
# ($0..$7) in pair order. Pair i (codes i, i + 4: nibbles 4 * i and 4 * i + 16, of w or of w >> 8) is
# masked, multiplied so that each nibble's magnitude lands on bits 6..8 of its half (bfloat16's exponent's
# two lowest bits and mantissa's top bit) and its sign on bit 15 (the two copies never overlap nor
# carry), and masked again: the bfloat16 of the code's value * 2^-126 (the exponent-0 codes as
# subnormals, as in `e2m1_words_as_float`). One bfloat16x2 product by 2^126 * scale (at most 2^127: finite;
# subnormal inputs are kept) then gives both weights exactly. 17 instructions for eight weights.
_FP4_PAIR_PTX = tl.constexpr("""{
.reg .b32 v, h, p0, p1, p2, p3;
shr.u32 h, $8, 8;
and.b32 v, $8, 0x000F000F; mul.lo.u32 v, v, 0x1040; and.b32 p0, v, 0x81C081C0;
and.b32 v, $8, 0x00F000F0; mul.lo.u32 v, v, 0x104; and.b32 p1, v, 0x81C081C0;
and.b32 v, h, 0x000F000F; mul.lo.u32 v, v, 0x1040; and.b32 p2, v, 0x81C081C0;
and.b32 v, h, 0x00F000F0; mul.lo.u32 v, v, 0x104; and.b32 p3, v, 0x81C081C0;
mul.rn.bf16x2 p0, p0, $9; mul.rn.bf16x2 p1, p1, $9; mul.rn.bf16x2 p2, p2, $9; mul.rn.bf16x2 p3, p3, $9;
mov.b32 {$0, $1}, p0; mov.b32 {$2, $3}, p1; mov.b32 {$4, $5}, p2; mov.b32 {$6, $7}, p3;
}""")


@triton.jit
def _fp4_pair_tile(words, scale_bytes):
    """[R, W] int32 words of eight e2m1 codes and [R, W // 4] e8m0 scale bytes (each at most 128) as the
    bfloat16 tile [R, W * 8] of the codes' values times their group's scale, in pair order."""
    rows: tl.constexpr = words.shape[0]
    groups: tl.constexpr = words.shape[1] // 4
    scale_bits = (scale_bytes + 126) << 7  # bfloat16 bits of 2^126 * 2^(byte - 127)
    c = tl.inline_asm_elementwise(
        _FP4_PAIR_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [tl.reshape(words, [rows, groups, 4]), (scale_bits | (scale_bits << 16))[:, :, None]],
        dtype=(tl.int16,) * 8, is_pure=True, pack=1,
    )
    w = [v.to(tl.bfloat16, bitcast=True) for v in c]  # pair order: codes 0, 4, 1, 5, 2, 6, 3, 7
    first = tl.permute(tl.join(tl.join(w[0], w[1]), tl.join(w[2], w[3])), (0, 1, 2, 4, 3))
    second = tl.permute(tl.join(tl.join(w[4], w[5]), tl.join(w[6], w[7])), (0, 1, 2, 4, 3))
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 2, 5, 3, 4)), [rows, groups * 32])


@triton.jit
def load_weight_tile(
    w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] tile of W (rows offs_n, columns k0..k0+BLOCK_K) in the COMPUTE dtype; FP8 unscaled,
    FP8_SCALED_TILES scaled by its (SCALE_BN x SCALE_BK) blocks.

    FP4 tiles (BLOCK_K a multiple of 32, k0 too) load their words and scales once each, as contiguous rows;
    FP4_PAIR_ORDER tiles come in pair order (`pair_order`).
    """
    rows = offs_n[:, None].to(tl.int64)
    if FORMAT == 4:  # FP8_SCALED_TILES: a scale per row and K block, spread over the block's columns
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        k_blocks = k0 // SCALE_BK + tl.arange(0, BLOCK_K // SCALE_BK)
        scale_bytes = tl.load(s_ptr + (offs_n[:, None] // SCALE_BN).to(tl.int64) * stride_sn + k_blocks[None, :],
                              mask=(offs_n[:, None] < N) & (k_blocks[None, :] < tl.cdiv(K, SCALE_BK)), other=127)
        tile = tl.reshape(w, [offs_n.shape[0], BLOCK_K // SCALE_BK, SCALE_BK]) * e8m0_to_float(scale_bytes)[:, :, None]
        return tl.reshape(tile, [offs_n.shape[0], BLOCK_K]).to(COMPUTE)
    elif FORMAT >= 2:
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        # K is whole 32-column groups, so its word count is a multiple of 4, written so that the compiler
        # sees it: the mask then covers four words at a time and a row's words load 16 bytes a thread
        # (K // 8 made them 8-byte copies through L1: the decode-sized MoE 8-9% slower, BENCHMARKS.md)
        packed = tl.load(w_ptr + rows * stride_wn + words[None, :],
                         mask=(offs_n[:, None] < N) & (words[None, :] < (K // 32) * 4), other=0)
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale_bytes = tl.load(s_ptr + rows * stride_sn + groups[None, :],
                              mask=(offs_n[:, None] < N) & (groups[None, :] < K // 32), other=127).to(tl.int32)
        if FORMAT == 5 and _PTX_DECODE:
            return _fp4_pair_tile(packed, scale_bytes).to(COMPUTE)
        values = e2m1_words_as_float(packed)
        if FORMAT == 2:  # any byte: 2^126 first (exact), then the scale
            tile = values * 8.507059173023462e37 * e8m0_to_float(scale_bytes)[:, :, None]
        else:  # scales <= 2: 2^126 * 2^(byte - 127) = 2^(byte - 1) is a float32, one product
            tile = values * ((scale_bytes + 126) << 23).to(tl.float32, bitcast=True)[:, :, None]
        tile = tl.reshape(tile, [offs_n.shape[0], BLOCK_K])
        if FORMAT == 5:
            tile = pair_order(tile)
        return tile.to(COMPUTE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        return tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(COMPUTE)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_grid(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    tile = load_weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, FORMAT, out_ptr.dtype.element_ty,
                            BLOCK_K, SCALE_BN, SCALE_BK)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + cols[None, :], tile,
             mask=(offs_n[:, None] < N) & (cols[None, :] < K))


def decoded_weight(
    weight: torch.Tensor, scale: torch.Tensor | None, fmt: int, dtype: torch.dtype, block_n: int = 16,
    block_k: int = 128, scale_block: tuple[int, int] = (1, 1),
) -> torch.Tensor:
    """The [N, K] weight (packed fp4: K twice its int8 columns) as `load_weight_tile` decodes it in FORMAT `fmt`
    into `dtype`, tile by tile: what the kernels multiply (FP8 unscaled, FP4_PAIR_ORDER in pair order). For
    checks of the decode against the dequantised weight (`scale_block`: FP8_SCALED_TILES' scale block)."""
    w, s = as_kernel_weight(weight, scale)
    k = w.shape[1] * (8 if weight.dtype == torch.int8 else 1)
    out = torch.empty(w.shape[0], k, dtype=dtype, device=w.device)
    grid = (triton.cdiv(w.shape[0], block_n), triton.cdiv(k, block_k))
    _decode_kernel[grid](w, s, out, w.shape[0], k, w.stride(0), s.stride(0), FORMAT=fmt,
                         BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BN=scale_block[0], SCALE_BK=scale_block[1],
                         **launch_options(w.device))
    return out


def pair_order_columns(t: torch.Tensor) -> torch.Tensor:
    """`pair_order` on the host: [R, C] with the columns of each 8 as 0, 4, 1, 5, 2, 6, 3, 7."""
    rows, cols = t.shape
    return t.view(rows, cols // 8, 2, 4).transpose(2, 3).reshape(rows, cols)
