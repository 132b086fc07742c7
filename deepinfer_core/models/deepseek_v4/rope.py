"""RoPE inverse frequencies for V4's two rope variants ("main" plain, "compress" optionally yarn)."""

from __future__ import annotations

import math

import torch

from deepinfer_core.model_config import RopeParams

__all__ = ["rope_inv_freq"]


def rope_inv_freq(params: RopeParams, rope_dim: int) -> torch.Tensor:
    """float32 [rope_dim / 2] angle per position for each interleaved pair.

    yarn follows transformers' truncated correction range and ignores its attention factor:
    V4 never scales cos/sin or the softmax by yarn's mscale.
    """
    base = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    inv_freq = 1.0 / (params.rope_theta**base)
    if params.rope_type == "default":
        return inv_freq
    low, high = (
        _correction_dim(params.beta_fast, rope_dim, params.rope_theta, params.original_max_position_embeddings),
        _correction_dim(params.beta_slow, rope_dim, params.rope_theta, params.original_max_position_embeddings),
    )
    low, high = max(math.floor(low), 0), min(math.ceil(high), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (inv_freq / params.factor) * (1 - keep) + inv_freq * keep


def _correction_dim(rotations: float, dim: int, theta: float, max_positions: int) -> float:
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))
