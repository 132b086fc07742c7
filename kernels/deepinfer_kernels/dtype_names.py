"""Dtypes handed to kernels as constexprs by name ("bfloat16", which torch and Triton share): a constexpr the
recorded launches' JSON can hold (`tests/kernel_launches.py`), where a Triton dtype would not serialise."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dtype_name", "triton_dtype"]


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name, the name of the Triton dtype of the same values."""
    return str(dtype).removeprefix("torch.")


@triton.constexpr_function
def triton_dtype(name):
    """The Triton dtype `dtype_name` names, inside a kernel."""
    return getattr(tl, name)
