"""Comparison used by the kernel tests: every element written, no NaN, close to the reference."""

from __future__ import annotations

import torch


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """‖out - ref‖ / ‖ref‖ <= rel, computed in float64; NaN or an unwritten (poisoned) element fails."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != reference {ref.dtype}"
    out64, ref64 = out.double(), ref.double()
    assert torch.isfinite(out64).all(), "kernel output has NaN/inf (an element left unwritten?)"
    error = float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))
    assert error <= rel, f"relative error {error:.3g} > {rel:.3g}"
