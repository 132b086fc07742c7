"""Run `deepinfer_kernels` through Triton's CPU interpreter: import this before any kernel module.

Sets TRITON_INTERPRET=1 (read when the kernel modules are imported), makes the in-tree `kernels/` and
`backends/nvidia/` packages importable when they are not installed, and works around Triton 3.6's interpreter turning scalar
kernel arguments into Python ints with `int(array)`, which numpy >= 2.4 refuses for 1-element arrays
(a `range(0, K, BLOCK)` loop over a runtime K would fail), and multiplying bfloat16 operands of
`tl.dot` as their raw uint16 storage (they are widened to float32 here, exact for bf16 products), and
casting float32 to bfloat16 by truncation (the GPU rounds to nearest even; so does the cast here).
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
    return _original_dot(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)


interpreter.InterpreterBuilder.create_dot = _create_dot

_original_cast = interpreter.InterpreterBuilder.cast_impl


def _cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _original_cast(self, src, dst_type)


interpreter.InterpreterBuilder.cast_impl = _cast_impl
