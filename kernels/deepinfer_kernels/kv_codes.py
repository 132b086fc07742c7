"""DeepSeek-V4.1's KV-cache codes (MODEL_SPEC_V41 §5), encoded and decoded in one pass each.

The reference ops spend 6-25 torch kernels a call on them (float32 copies, block maxima, exponent bits,
thresholds, packing), and a V4.1 decode step calls them ~40 times: for the window K=V, the compressed
entries, the indexer's keys and queries, and their reads. Here one launch reads each vector once; a cache
read decodes the vectors where they lie (`rows`), and a cache write encodes into them (`out`, `rows`).

Every conversion is written on the bits, for the same result in the interpreter, on sm_90 and on SM100:
float32 to e4m3 rounds to nearest even and saturates at 448 (Triton's own float8 cast differs in the
interpreter; the reference clamps e4m3 scales at 448 first, as torch's cast saturates on the CPU and not on
CUDA), e4m3 and e2m1 decode from their fields, powers of two from exponent bits. The divisions by an e4m3
scale are IEEE (`div_rn`), as torch's; by a power of two they are exact. So the codes and values equal the
reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["codes_supported", "fp4_block_dequantize", "fp4_block_quantize", "fp8_block_dequantize", "fp8_block_quantize"]

ROWS_PER_PROGRAM = 8


def codes_supported(width: int, block: int) -> bool:
    """Blocks the kernels tile: a power of two of at least 2 channels that divides the vector's width."""
    return block >= 2 and block & (block - 1) == 0 and width % block == 0


@triton.jit
def _pow2(k):
    """2.0 ** k for int32 k in the normal range, from the exponent bits (exact, unlike an approximate exp2)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_value(byte):
    """2^(byte - 127) for int32 bytes 0..255, from the bits: 0 is the subnormal 2^-127, 255 infinity (as
    torch's exp2). (2^-127 written as a float literal came out one subnormal step too large on the H200.)"""
    return tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(byte):
    """float32 of e4m3fn bytes (int32): sign, 4 exponent bits of bias 7 (subnormals at 0), 3 mantissa bits;
    S.1111.111 is NaN."""
    exp_bits = (byte >> 3) & 15
    mant = (byte & 7).to(tl.float32)
    value = tl.where(exp_bits == 0, mant * 0.001953125, _pow2(exp_bits - 7) * (1.0 + 0.125 * mant))
    value = tl.where((byte & 0x80) != 0, -value, value)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _e4m3_code(x):
    """The e4m3fn byte (int32) of finite float32 x, rounded to nearest even, saturated at +-448."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    # normal: drop 20 of float32's 23 mantissa bits with round-to-nearest-even (a carry moves the exponent),
    # then rebias the exponent from 127 to 7
    mag_bits = magnitude.to(tl.int32, bitcast=True)
    normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 0x7E)
    # below 2^-6: multiples of 2^-9, the count rounded to nearest even by adding 2^23 (exact, then rounded)
    subnormal = (magnitude * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(magnitude >= 0.015625, normal, subnormal)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _ceil_log2(t):
    """int32 ceil(log2(t)) of positive normal float32 t, from the bits: exponent - 127, +1 if mantissa != 0."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e2m1_value(code):
    """float32 value of 4-bit e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, _pow2(exponent - 1) * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1_magnitude(a):
    """e2m1 magnitude code of |q| <= 6: the thresholds 0.25 .. 5.0, ties to the even code (down at 0.25, 1.25,
    2.5, 5.0; up at 0.75, 1.75, 3.5)."""
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))


@triton.jit
def _row_blocks(x_ptr, rows, width, N_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows of x as float32 [ROWS, N_BLOCKS, BLOCK] (zeros past the ends), their int64 row
    ids and the validity of each block."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, N_BLOCKS * BLOCK)
    row64 = row.to(tl.int64)[:, None]
    x = tl.load(x_ptr + row64 * width + col[None, :], mask=(row[:, None] < rows) & (col[None, :] < width), other=0.0)
    blocks = tl.reshape(x.to(tl.float32), (ROWS, N_BLOCKS, BLOCK))
    block_ok = (row[:, None] < rows) & (tl.arange(0, N_BLOCKS)[None, :] * BLOCK < width)
    return blocks, row64, block_ok


@triton.jit
def _vector_ids(row, rows, ids_ptr, INDIRECT: tl.constexpr):
    """int64 [ROWS, 1] ids of the parts' vectors that rows `row` of a call decode or encode: the rows themselves,
    or ids_ptr's (a paged cache read or write)."""
    if INDIRECT:
        return tl.load(ids_ptr + row, mask=row < rows, other=0).to(tl.int64)[:, None]
    return row.to(tl.int64)[:, None]


@triton.jit
def _fp8_encode_kernel(
    x_ptr, codes_ptr, exponents_ptr, ids_ptr, rows, width, SCATTER: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    blocks, row64, block_ok = _row_blocks(x_ptr, rows, width, N_BLOCKS, BLOCK, ROWS)
    target = _vector_ids(tl.program_id(0) * ROWS + tl.arange(0, ROWS), rows, ids_ptr, SCATTER)
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), 1e-4)
    exponent = _ceil_log2(amax * (1.0 / 448.0))
    q = tl.clamp(blocks * _pow2(-exponent)[:, :, None], -448.0, 448.0)  # x / 2^e, exact
    codes = tl.reshape(_e4m3_code(q), (ROWS, N_BLOCKS * BLOCK))
    col = tl.arange(0, N_BLOCKS * BLOCK)
    tl.store(codes_ptr + target * width + col[None, :], codes.to(tl.uint8),
             mask=(row64 < rows) & (col[None, :] < width))
    n_scales = width // BLOCK
    tl.store(exponents_ptr + target * n_scales + tl.arange(0, N_BLOCKS)[None, :], (exponent + 127).to(tl.uint8),
             mask=block_ok)


@triton.jit
def _fp8_decode_kernel(
    codes_ptr, exponents_ptr, rows_ptr, out_ptr, rows, width, GATHER: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, N_BLOCKS * BLOCK)
    row64 = row.to(tl.int64)[:, None]
    source = _vector_ids(row, rows, rows_ptr, GATHER)
    ok = (row[:, None] < rows) & (col[None, :] < width)
    codes = tl.load(codes_ptr + source * width + col[None, :], mask=ok, other=0).to(tl.int32)
    exponents = tl.load(exponents_ptr + source * (width // BLOCK) + col[None, :] // BLOCK, mask=ok, other=127)
    values = _e4m3_value(codes) * _ue8m0_value(exponents.to(tl.int32))
    tl.store(out_ptr + row64 * width + col[None, :], values.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp4_encode_kernel(
    x_ptr, packed_ptr, scales_ptr, ids_ptr, rows, width, SCATTER: tl.constexpr, E4M3: tl.constexpr,
    N_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    blocks, row64, block_ok = _row_blocks(x_ptr, rows, width, N_BLOCKS, BLOCK, ROWS)
    target = _vector_ids(tl.program_id(0) * ROWS + tl.arange(0, ROWS), rows, ids_ptr, SCATTER)
    amax = tl.max(tl.abs(blocks), axis=2)
    if E4M3:  # e4m3(max(amax, 6 * 2^-9) / 6), then the division by its value
        scale_bytes = _e4m3_code(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0))
        q = tl.math.div_rn(blocks, _e4m3_value(scale_bytes)[:, :, None])
    else:  # 2^ceil(log2(max(amax, 6 * 2^-126) / 6)): the division is exact
        exponent = _ceil_log2(tl.maximum(amax, 7.052966104933725e-38) * (1.0 / 6.0))
        scale_bytes = exponent + 127
        q = blocks * _pow2(-exponent)[:, :, None]
    magnitude = _e2m1_magnitude(tl.abs(tl.clamp(q, -6.0, 6.0)))
    codes = magnitude | ((blocks.to(tl.int32, bitcast=True) >> 28) & 8)  # q's sign is x's: the scale is positive
    pairs = tl.reshape(codes, (ROWS, N_BLOCKS * BLOCK // 2, 2))
    even, odd = tl.split(pairs)
    pair = tl.arange(0, N_BLOCKS * BLOCK // 2)
    tl.store(packed_ptr + target * (width // 2) + pair[None, :], (even | (odd << 4)).to(tl.uint8),
             mask=(row64 < rows) & (pair[None, :] < width // 2))
    tl.store(scales_ptr + target * (width // BLOCK) + tl.arange(0, N_BLOCKS)[None, :], scale_bytes.to(tl.uint8),
             mask=block_ok)


@triton.jit
def _fp4_decode_kernel(
    packed_ptr, scales_ptr, rows_ptr, out_ptr, rows, pairs, n_scales, GATHER: tl.constexpr,
    PAIRS_PER_SCALE: tl.constexpr, E4M3: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pair = tl.arange(0, BLOCK_P)
    ok = (row[:, None] < rows) & (pair[None, :] < pairs)
    row64 = row.to(tl.int64)[:, None]
    source = _vector_ids(row, rows, rows_ptr, GATHER)
    byte = tl.load(packed_ptr + source * pairs + pair[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(scales_ptr + source * n_scales + pair[None, :] // PAIRS_PER_SCALE, mask=ok, other=127).to(tl.int32)
    # every byte decodes as torch does (a written scale is positive and finite, but the codes are the data)
    scale = _e4m3_value(s) if E4M3 else _ue8m0_value(s)
    low = _e2m1_value(byte & 15) * scale
    high = _e2m1_value(byte >> 4) * scale
    values = tl.reshape(tl.join(low, high), (ROWS, 2 * BLOCK_P))
    col = tl.arange(0, 2 * BLOCK_P)
    out_ok = (row[:, None] < rows) & (col[None, :] < 2 * pairs)
    tl.store(out_ptr + row64 * (2 * pairs) + col[None, :], values.to(out_ptr.dtype.element_ty), mask=out_ok)


def _rows_per_program(rows: int) -> int:
    """ROWS_PER_PROGRAM, or the next power of two of fewer rows: a program computes all of its rows, used or
    not, and a decode step brings one entry a sequence."""
    return min(ROWS_PER_PROGRAM, triton.next_power_of_2(rows))


def fp8_block_quantize(
    x: torch.Tensor, block: int, out: tuple[torch.Tensor, ...] | None = None, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """`KernelOps.fp8_block_quantize`: x [..., d] -> (float8_e4m3fn [..., d], uint8 exponents [..., d/block]);
    with `out` and int64 `rows` [N] (x [N, d]), written to those vectors of out's contiguous parts instead."""
    width = x.shape[-1]
    n_rows = x.numel() // max(width, 1)
    codes, exponents = _targets(out, rows, (x.shape, (*x.shape[:-1], width // block)), x.device)
    if n_rows and width:
        per_program = _rows_per_program(n_rows)
        _fp8_encode_kernel[(triton.cdiv(n_rows, per_program),)](
            x.contiguous(), codes, exponents, codes if rows is None else rows.reshape(-1), n_rows, width,
            SCATTER=rows is not None, N_BLOCKS=triton.next_power_of_2(width // block), BLOCK=block,
            ROWS=per_program, **launch_options(x.device),
        )
    return out if out is not None else (codes.view(torch.float8_e4m3fn), exponents)


def _targets(
    out: tuple[torch.Tensor, ...] | None, rows: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...],
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """The uint8 tensors an encode writes: new ones of `shapes`, or the parts `out` (viewed as bytes)."""
    if (out is None) != (rows is None):
        raise ValueError("an encode writes into `out` at `rows`: give both or neither")
    if out is None:
        return tuple(torch.empty(shape, dtype=torch.uint8, device=device) for shape in shapes)
    if not all(part.is_contiguous() for part in out):
        raise ValueError("the parts an encode writes into must be contiguous")
    return tuple(part.view(torch.uint8) for part in out)


def _output(vectors: torch.Tensor, width: int, dtype: torch.dtype, rows: torch.Tensor | None):
    """(out [*vectors' or rows' leading shape, width], its row count, the row ids to pass or a dummy)."""
    lead = vectors.shape[:-1] if rows is None else rows.shape
    out = torch.empty((*lead, width), dtype=dtype, device=vectors.device)
    return out, out.numel() // max(width, 1), out if rows is None else rows.reshape(-1)


def fp8_block_dequantize(
    values: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`KernelOps.fp8_block_dequantize`: e4m3 values [..., d] times 2^(exponents - 127) per block, as `dtype`;
    with int64 `rows`, those vectors of the parts flattened over their leading dims."""
    width = values.shape[-1]
    out, n_rows, row_ids = _output(values, width, dtype, rows)
    if n_rows and width:
        block = width // exponents.shape[-1]
        per_program = _rows_per_program(n_rows)
        _fp8_decode_kernel[(triton.cdiv(n_rows, per_program),)](
            values.contiguous().view(torch.uint8), exponents.contiguous(), row_ids, out, n_rows, width,
            GATHER=rows is not None, N_BLOCKS=triton.next_power_of_2(width // block), BLOCK=block,
            ROWS=per_program, **launch_options(values.device),
        )
    return out


def fp4_block_quantize(
    x: torch.Tensor, block: int, scale_format: str, out: tuple[torch.Tensor, ...] | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """`KernelOps.fp4_block_quantize`: x [..., d] -> (packed uint8 [..., d/2], channel 2j in the low nibble;
    scales float8_e4m3fn or uint8 ue8m0 [..., d/block]); `out` and `rows` as in `fp8_block_quantize`."""
    width = x.shape[-1]
    n_rows = x.numel() // max(width, 1)
    packed, scales = _targets(out, rows, ((*x.shape[:-1], width // 2), (*x.shape[:-1], width // block)), x.device)
    if n_rows and width:
        per_program = _rows_per_program(n_rows)
        _fp4_encode_kernel[(triton.cdiv(n_rows, per_program),)](
            x.contiguous(), packed, scales, packed if rows is None else rows.reshape(-1), n_rows, width,
            SCATTER=rows is not None, E4M3=scale_format == "e4m3", N_BLOCKS=triton.next_power_of_2(width // block),
            BLOCK=block, ROWS=per_program, **launch_options(x.device),
        )
    if out is not None:
        return out
    return packed, scales.view(torch.float8_e4m3fn) if scale_format == "e4m3" else scales


def fp4_block_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`KernelOps.fp4_block_dequantize`: packed uint8 [..., d/2] (channel 2j in the low nibble), scales
    float8_e4m3fn or uint8 (ue8m0) [..., d/block] -> [..., d] in `dtype`; `rows` as in fp8_block_dequantize."""
    pairs, n_scales = packed.shape[-1], scales.shape[-1]
    out, n_rows, row_ids = _output(packed, 2 * pairs, dtype, rows)
    if n_rows == 0 or pairs == 0:
        return out
    block = 2 * pairs // n_scales
    per_program = _rows_per_program(n_rows)
    _fp4_decode_kernel[(triton.cdiv(n_rows, per_program),)](
        packed.contiguous(), scales.contiguous().view(torch.uint8), row_ids, out, n_rows, pairs, n_scales,
        GATHER=rows is not None, PAIRS_PER_SCALE=block // 2, E4M3=scales.dtype == torch.float8_e4m3fn,
        ROWS=per_program, BLOCK_P=triton.next_power_of_2(pairs), **launch_options(packed.device),
    )
    return out
