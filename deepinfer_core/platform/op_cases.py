"""Conformance cases: for each `KernelOps` op, fresh random inputs and the tolerance it must meet.

The conformance suite (`platform/conformance.py`, `deepinfer check-backend NAME`) runs every case
through the backend's ops and through the reference `KernelOps`, and compares outputs. Inputs are
drawn from a seeded generator on the CPU and moved to the device, never zeros.

Add a case here whenever an op is added to `KernelOps`: a test fails for any op without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["OpCase", "OP_CASES"]


@dataclass(frozen=True, slots=True)
class OpCase:
    """One conformance case.

    make_inputs(gen, dtype) returns (args, kwargs) on the CPU; the runner moves tensors to the
    backend's device. rtol/atol map each dtype to the tolerance (with the reason in a comment
    where it is defined); the comparison is torch.testing-style on every output tensor.
    """

    op: str
    name: str
    make_inputs: Callable[[torch.Generator, torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    rtol: dict[torch.dtype, float] = field(default_factory=dict)
    atol: dict[torch.dtype, float] = field(default_factory=dict)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# float32: a different summation order moves results by a few ulps.
# bfloat16: inputs are bf16 but reference and kernel may accumulate differently before rounding.
_TOL_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
_TOL_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

OP_CASES: list[OpCase] = [
    OpCase(
        "rms_norm", "weighted_odd_width",
        lambda g, dt: ((_randn(g, 7, 3, 131, dtype=dt), _randn(g, 131).abs() + 0.5, 1e-6), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "rms_norm", "unweighted",
        lambda g, dt: ((_randn(g, 5, 64, dtype=dt), None, 1e-6), {}),
        rtol=_TOL_RTOL, atol=_TOL_ATOL,
    ),
    OpCase(
        "linear", "odd_shapes",
        lambda g, dt: ((_randn(g, 13, 96, dtype=dt), _randn(g, 37, 96, dtype=dt) / 10), {}),
        rtol=_TOL_RTOL, atol={torch.float32: 1e-4, torch.bfloat16: 3e-2},
    ),
]
