"""Run `deepinfer_kernels` through Triton's CPU interpreter: import this before any kernel module.

Sets TRITON_INTERPRET=1 (read when the kernel modules are imported), makes the in-tree `kernels/` and
`backends/nvidia/` packages importable when they are not installed, and works around Triton 3.6's interpreter turning scalar
kernel arguments into Python ints with `int(array)`, which numpy >= 2.4 refuses for 1-element arrays
(a `range(0, K, BLOCK)` loop over a runtime K would fail), and multiplying bfloat16 operands of
`tl.dot` as their raw uint16 storage (they are widened to float32 here, exact for bf16 products),
summing float `tl.dot`s in numpy's float32 matmul, whose order can depend on an element's place in the
product (they are summed in float64 here and rounded once), and casting float32 to bfloat16 by
truncation (the GPU rounds to nearest even; so does the cast here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (Linux only): kernel tests need its interpreter")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]
for _package, _directory in (("deepinfer_kernels", _REPO / "kernels"), ("deepinfer_nvidia", _REPO / "backends" / "nvidia")):
    try:
        __import__(_package)
    except ImportError:
        sys.path.insert(0, str(_directory))

_original_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


interpreter._patch_lang_tensor = _patch_lang_tensor

_original_dot = interpreter.InterpreterBuilder.create_dot


def _widened(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return interpreter.TensorHandle(data, tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    a, b = _widened(a), _widened(b)
    if not (a.dtype.is_floating() and b.dtype.is_floating() and d.dtype.is_floating()):
        return _original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    # Equal rows or columns must give equal sums, as on the GPU, whose MMA sums every element of a tile in
    # one order. numpy's float32 matmul does not (OpenBLAS' AVX2 kernels sum edge columns in another
    # order: exact ties came out an ulp apart). In float64 the products of float32 (or narrower) operands
    # are exact and two orders' sums differ by float64 ulps, which round to one float32 but in the rarest case.
    a_data, b_data = (_as_float64(handle) for handle in (a, b))
    return interpreter.TensorHandle(np.matmul(a_data, b_data).astype(d.data.dtype) + d.data, d.dtype.scalar)


def _as_float64(handle):
    if handle.dtype.primitive_bitwidth == 8:  # fp8 codes: as the interpreter reads them, through float16
        return interpreter._convert_float(handle.data, handle.dtype, tl.float16, None).view(np.float16).astype(np.float64)
    return handle.data.astype(np.float64)


interpreter.InterpreterBuilder.create_dot = _create_dot

_original_cast = interpreter.InterpreterBuilder.cast_impl


def _cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _original_cast(self, src, dst_type)


interpreter.InterpreterBuilder.cast_impl = _cast_impl
