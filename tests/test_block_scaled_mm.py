"""Prefill-sized projections on cuBLAS (`TritonOps._dense_on_cublas`, `block_scaled_mm`) against the reference ops.

The dispatch (which projections go, how a grouped W8A8 projection is cut into its groups), with the reference's
W8A8 standing in for cuBLAS's block-scaled GEMM; the GEMM itself is checked at real shapes on the GPU by
`scripts/check_kernels_gpu.py` (the `linear` / `grouped_linear` fp8-a8 cases at 8,192 rows take it)."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch

from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import quantize_fp4, quantize_fp8_block
from deepinfer_nvidia.block_scaled_mm import block_scaled_supported
from deepinfer_nvidia.ops import (
    CUBLAS_FLOAT32_ROWS, CUBLAS_ROWS, CUBLAS_W8A8_WIDENED_ROWS, CUBLAS_W8A16_ROWS, TritonOps,
)


def _fp8_weight(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) / 8
    return quantize_fp8_block(w, (128, 128))


def _w8a8(ops_type: type[KernelOps]) -> KernelOps:
    ops = ops_type()
    ops.fp8_activations = True
    return ops


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_prefill_sized_projections_of_unquantised_x_are_the_reference_op(fmt):
    """Dense and fp8 weights (W8A16, from more rows) meeting many bf16 rows: the reference op itself; fp4 weights,
    fewer rows and batch-invariant mode: the Triton tiles."""
    gen = torch.Generator().manual_seed(1)
    rows = {"dense": CUBLAS_ROWS, "fp8": CUBLAS_W8A16_ROWS, "fp4": CUBLAS_W8A16_ROWS}[fmt]
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(128, 256, generator=gen) / 8
    weight, scale, block = {"dense": (w.to(torch.bfloat16), None, None),
                            "fp8": (*quantize_fp8_block(w, (32, 64)), (32, 64)), "fp4": (*quantize_fp4(w), None)}[fmt]
    ops, reference = TritonOps(), KernelOps()
    on_cublas = fmt != "fp4"
    assert ops._dense_on_cublas(x.dtype, x.device, weight, block, rows) == on_cublas
    if on_cublas:
        assert torch.equal(ops.linear(x, weight, scale, block), reference.linear(x, weight, scale, block))
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, block, rows - 1)
    ops.batch_invariant = True
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, block, rows)
    if fmt == "dense":
        grouped = x.view(rows, 2, 128)
        assert torch.equal(TritonOps().grouped_linear(grouped, weight[:, :128]),
                           reference.grouped_linear(grouped, weight[:, :128]))


def test_w8a8_of_prefill_size_goes_to_the_block_scaled_gemm(monkeypatch):
    """`linear` hands x [.., K] to it as rows [M, K] and gives back [.., N]; fewer rows, batch-invariant mode and the
    grouped projection keep the Triton tiles (the reference's W8A8 stands in for cuBLAS)."""
    gen = torch.Generator().manual_seed(2)
    n, k = 128, 512
    x = torch.randn(CUBLAS_ROWS // 2, 2, k, generator=gen).to(torch.bfloat16)
    weight, scale = _fp8_weight(2 * n, k, gen)
    reference = _w8a8(KernelOps)
    calls = []

    def stand_in(rows, w, s):
        calls.append((rows.shape, w.shape, s.shape))
        return reference.linear(rows, w, s, (128, 128))

    ops = _w8a8(TritonOps)
    monkeypatch.setattr(ops, "_block_scaled_supported", lambda *args: True)
    monkeypatch.setattr(ops, "_block_scaled_mm", stand_in)
    out = ops.linear(x, weight, scale, (128, 128))
    assert calls == [((CUBLAS_ROWS, k), (2 * n, k), (2, 4))]
    assert torch.equal(out, reference.linear(x, weight, scale, (128, 128)))
    ops.linear(x[:-1], weight, scale, (128, 128))
    ops.grouped_linear(x, weight, scale, (128, 128))
    ops.batch_invariant = True
    ops.linear(x, weight, scale, (128, 128))
    assert len(calls) == 1


def test_w8a8_of_prefill_size_in_small_blocks_is_the_reference_op(monkeypatch):
    """Weight blocks the block-scaled GEMM does not take (V4.1's 32 x 32), from `CUBLAS_W8A8_WIDENED_ROWS`: x rounded
    to its fp8 values (the backend's `fake_quantize_activations`), the weight widened, one bf16 product: the reference
    W8A8's bits; 128 x 128 blocks the block-scaled GEMM takes stay off this path."""
    gen = torch.Generator().manual_seed(4)
    rows = CUBLAS_W8A8_WIDENED_ROWS
    x = (torch.randn(rows, 64, generator=gen) * 3).to(torch.bfloat16)
    weight, scale = quantize_fp8_block(torch.randn(96, 64, generator=gen) / 8, (32, 32))
    ops, reference = _w8a8(TritonOps), _w8a8(KernelOps)
    assert ops._dense_on_cublas(x.dtype, x.device, weight, (32, 32), rows)
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, (32, 32), rows - 1)
    assert torch.equal(ops.linear(x, weight, scale, (32, 32)), reference.linear(x, weight, scale, (32, 32)))
    monkeypatch.setattr(ops, "_block_scaled_supported", lambda *args: True)
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, (128, 128), rows)


def test_float32_x_of_prefill_size_is_the_reference_op():
    """V4.1's compressor projects a float32 x by a bf16 weight: from `CUBLAS_FLOAT32_ROWS` the reference's float32
    product (not in batch-invariant mode)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(CUBLAS_FLOAT32_ROWS, 64, generator=gen)
    weight = (torch.randn(48, 64, generator=gen) / 8).to(torch.bfloat16)
    ops = TritonOps()
    assert ops._dense_on_cublas(x.dtype, x.device, weight, None, CUBLAS_FLOAT32_ROWS)
    assert torch.equal(ops.linear(x, weight), KernelOps().linear(x, weight))
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, None, CUBLAS_FLOAT32_ROWS - 1)
    ops.batch_invariant = True
    assert not ops._dense_on_cublas(x.dtype, x.device, weight, None, CUBLAS_FLOAT32_ROWS)


def test_only_whole_128_blocks_on_a_device_that_has_it():
    gen = torch.Generator().manual_seed(3)
    weight, _ = _fp8_weight(256, 512, gen)
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    assert not block_scaled_supported(x.dtype, x.device, weight, (128, 128), 8), "the CPU has no cuBLAS"
    assert not block_scaled_supported(x.dtype, x.device, weight, (64, 64), 8)

