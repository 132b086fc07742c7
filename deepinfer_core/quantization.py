"""Weight formats of the DeepSeek-V4 release (MODEL_SPEC §8): fp8 block-scaled and fp4 (MXFP4) experts.

Both formats scale by powers of two stored as raw e8m0 exponent bytes (`float8_e8m0fnu`, value
2^(byte - 127)), so dequantisation is exact in float32 and in bfloat16.

- fp8: `float8_e4m3fn` [N, K] with one scale per (128 x 128) block, shape [ceil(N/128), ceil(K/128)].
- fp4: e2m1 codes packed two per byte in int8 [N, K/2] (column 2j in the low nibble, 2j+1 in the high
  nibble), one scale per 32 consecutive columns of a row, shape [N, K/32].

Activations meeting fp8 weights may be quantised too (`KernelOps.fp8_activations`), as DeepSeek's own
inference does (dynamic, per token and per group of K columns, power-of-two scales):
`fake_quantize_fp8_activations` is that rounding, the reference the fp8 kernels must reproduce.
"""

import torch

__all__ = [
    "FP4_BLOCK",
    "FP4_VALUES",
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "QuantizationFormatError",
    "dequantize_fp4",
    "dequantize_fp8_activations",
    "dequantize_fp8_block",
    "fake_quantize_fp8_activations",
    "quantize_fp4",
    "quantize_fp8_activations",
    "quantize_fp8_block",
]

FP8_BLOCK = (128, 128)
FP8_E4M3_MAX = 448.0
FP4_BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
# Activation groups whose largest magnitude is below this share its scale (DeepSeek's act_quant clamp):
# an all-zero group needs no special case.
FP8_ACTIVATION_AMAX_FLOOR = 1e-4

E8M0_BIAS = 127
# Midpoints between neighbouring e2m1 magnitudes; a tie rounds to the even code (round-half-to-even).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


class QuantizationFormatError(ValueError):
    """A quantised tensor or its scale does not have the dtype or shape its format requires."""


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """W[i, j] = weight[i, j] * 2^(scale[i // bn, j // bk] - 127), computed in float32, returned as `dtype`."""
    _expect_dtype("fp8 weight", weight, torch.float8_e4m3fn)
    _expect_dtype("fp8 scale", scale, torch.float8_e8m0fnu)
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (_ceil_div(rows, block_rows), _ceil_div(cols, block_cols))
    if tuple(scale.shape) != expected:
        raise QuantizationFormatError(
            f"fp8 scale for a weight of shape {list(weight.shape)} with blocks {list(block)} must have shape "
            f"{list(expected)}, found {list(scale.shape)}"
        )
    # Scale in place, block column by block column group, so no [N, K] tensor of factors is built.
    row_factors = scale.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]  # [N, ceil(K/bk)]
    w = weight.to(torch.float32).contiguous()
    full = cols // block_cols
    w[:, : full * block_cols].view(rows, full, block_cols).mul_(row_factors[:, :full, None])
    w[:, full * block_cols :].mul_(row_factors[:, full:])
    return w.to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a float [N, K] matrix to (float8_e4m3fn [N, K], float8_e8m0fnu [ceil(N/bn), ceil(K/bk)]).

    Each block's scale is the smallest power of two s with amax / s <= 448, so no value saturates.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise QuantizationFormatError(f"fp8 quantisation expects a 2-D float matrix, found {w.dtype} {list(w.shape)}")
    rows, cols = w.shape
    block_rows, block_cols = block
    padded = _pad_to_multiple(w.to(torch.float32), block_rows, block_cols)
    blocks = padded.unflatten(0, (-1, block_rows)).unflatten(2, (-1, block_cols))  # [nr, br, nc, bc]
    amax = blocks.abs().amax(dim=(1, 3))
    exponent = _scale_exponent(amax, FP8_E4M3_MAX)
    factors = torch.ldexp(torch.ones_like(amax), exponent.to(torch.float32))
    scaled = blocks / factors[:, None, :, None]
    quantised = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).flatten(2, 3).flatten(0, 1)[:rows, :cols]
    return quantised.to(torch.float8_e4m3fn).contiguous(), _e8m0_from_exponent(exponent)


def quantize_fp8_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] quantised as an fp8 kernel quantises it before its MMAs: (float8_e4m3fn codes [..., K], float32
    scales [..., ceil(K / group)]), x ~ codes * scale of the column's group.

    Each row's consecutive `group` columns share the scale 2^e, e the smallest with
    max(amax, 1e-4) <= 448 * 2^e; each value becomes the nearest e4m3 value (ties to even) of x / 2^e.
    """
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, _ceil_div(cols, group) * group - cols))
    groups = padded.unflatten(-1, (-1, group))
    amax = groups.abs().amax(dim=-1).clamp(min=FP8_ACTIVATION_AMAX_FLOOR)
    exponent = _scale_exponent(amax, FP8_E4M3_MAX).to(torch.float32)
    codes = torch.ldexp(groups, -exponent[..., None]).to(torch.float8_e4m3fn)
    return codes.flatten(-2)[..., :cols], torch.ldexp(torch.ones_like(exponent), exponent)


def dequantize_fp8_activations(
    codes: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """`quantize_fp8_activations`' codes times their scales, in `dtype` (exact: e4m3 values times powers of two fit
    bfloat16 and float32)."""
    cols = codes.shape[-1]
    values = codes.float() * scales.repeat_interleave(group, dim=-1)[..., :cols]
    return values.to(dtype)


def fake_quantize_fp8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as an fp8 kernel quantises it before its MMAs (`quantize_fp8_activations`); returned in
    x.dtype, exactly."""
    return dequantize_fp8_activations(*quantize_fp8_activations(x, group), group, x.dtype)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Unpack int8 [N, K/2] e2m1 codes and apply the e8m0 scales [N, K/32]; returns `dtype` [N, K]."""
    _expect_dtype("fp4 packed weight", packed, torch.int8)
    _expect_dtype("fp4 scale", scale, torch.float8_e8m0fnu)
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % FP4_BLOCK or tuple(scale.shape) != (rows, cols // FP4_BLOCK):
        raise QuantizationFormatError(
            f"fp4 packed weight {list(packed.shape)} (unpacked [{rows}, {cols}]) needs a width that is a multiple of "
            f"{FP4_BLOCK} and a scale of shape [{rows}, {cols // FP4_BLOCK}], found {list(scale.shape)}"
        )
    codes = packed.view(torch.uint8)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    low = table[(codes & 0x0F).long()]
    high = table[(codes >> 4).long()]
    values = torch.stack((low, high), dim=-1).view(rows, -1, FP4_BLOCK)
    return (values * scale.to(torch.float32)[..., None]).view(rows, cols).to(dtype)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a float [N, K] matrix (K divisible by 32) to (int8 [N, K/2], float8_e8m0fnu [N, K/32]).

    Each 32-column block's scale is the smallest power of two s with amax / s <= 6; values round to the
    nearest e2m1 magnitude, ties to the even code.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise QuantizationFormatError(f"fp4 quantisation expects a 2-D float matrix, found {w.dtype} {list(w.shape)}")
    rows, cols = w.shape
    if cols % FP4_BLOCK:
        raise QuantizationFormatError(
            f"fp4 quantisation needs the input dimension to be a multiple of {FP4_BLOCK}, found {cols}"
        )
    blocks = w.to(torch.float32).unflatten(1, (-1, FP4_BLOCK))  # [N, K/32, 32]
    exponent = _scale_exponent(blocks.abs().amax(dim=2), FP4_MAX)
    factors = torch.ldexp(torch.ones_like(blocks[..., 0]), exponent.to(torch.float32))
    scaled = (blocks / factors[..., None]).flatten(1)
    codes = _e2m1_codes(scaled)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), _e8m0_from_exponent(exponent)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.abs().clamp(max=FP4_MAX)[..., None]
    midpoints = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=x.device)
    rounds_up = torch.tensor(_FP4_TIE_ROUNDS_UP, device=x.device)
    above = torch.where(rounds_up, magnitude >= midpoints, magnitude > midpoints)
    code = above.sum(dim=-1).to(torch.uint8)
    negative = (x < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def _scale_exponent(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Smallest e with amax <= max_value * 2^e, clamped to the e8m0 range; an all-zero block gets e = -127."""
    mantissa, exponent = torch.frexp(amax / max_value)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    # amax / max_value is rounded; one step up when the rounding hid an excess.
    limit = torch.ldexp(torch.full_like(amax, max_value), exponent.to(amax.dtype))
    exponent = torch.where(amax > limit, exponent + 1, exponent)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def _e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()


def _pad_to_multiple(w: torch.Tensor, row_multiple: int, col_multiple: int) -> torch.Tensor:
    rows, cols = w.shape
    pad_rows = _ceil_div(rows, row_multiple) * row_multiple - rows
    pad_cols = _ceil_div(cols, col_multiple) * col_multiple - cols
    return torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _expect_dtype(what: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise QuantizationFormatError(f"{what} must be {dtype}, found {tensor.dtype}")
    if tensor.dim() != 2:
        raise QuantizationFormatError(f"{what} must be 2-D, found shape {list(tensor.shape)}")
