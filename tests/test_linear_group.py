"""`LinearGroup`: projections of one input stacked into one weight per format, filled by their own names."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.linear import Linear, LinearGroup
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import quantize_fp8_block


def _parent() -> nn.Module:
    """fp8 parts of whole and of partial scale blocks, and dense parts, interleaved."""
    ops, cpu = KernelOps(), torch.device("cpu")
    parent = nn.Module()
    shapes = (("a", 256, "fp8"), ("b", 64, "dense"), ("c", 128, "fp8"), ("d", 96, "fp8"), ("e", 32, "dense"))
    for name, rows, fmt in shapes:
        setattr(parent, name, Linear(128, rows, ops, dtype=torch.float32, device=cpu, fmt=fmt, block=(128, 128)))
    parent.group = LinearGroup(*(getattr(parent, name) for name, _, _ in shapes))
    return parent


def test_group_equals_its_parts_and_keeps_their_names():
    parent = _parent()
    gen = torch.Generator().manual_seed(0)
    assert sorted(parent.state_dict()) == sorted(f"{n}.{t}" for n in "abcde" for t in ("weight", "scale")
                                                  if getattr(getattr(parent, n), t) is not None)
    for name, tensor in parent.state_dict().items():  # as the weight loader fills them, in place
        if tensor.dtype == torch.float8_e4m3fn:
            part = getattr(parent, name.split(".")[0])
            weight, scale = quantize_fp8_block(torch.randn(tensor.shape, generator=gen), (128, 128))
            part.weight.copy_(weight)
            part.scale.copy_(scale)
        elif tensor.dtype == torch.float32:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    x = torch.randn(5, 128, generator=gen)
    outs = parent.group(x)
    # stacks: a + c (fp8, whole blocks), b + e (dense), d alone (96 rows: not a whole scale block)
    assert len(parent.group._stacks) == 3
    for name, out in zip("abcde", outs):
        assert torch.allclose(out, getattr(parent, name)(x), rtol=1e-6, atol=1e-6), name
    stack_a = parent.group._stacks[0][0]
    assert parent.c.weight.data_ptr() == stack_a.data_ptr() + 256 * 128  # a view of the stack, after a
