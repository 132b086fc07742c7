"""The V4.1 KV-cache formats (MODEL_SPEC_V41 §5): how the cache stores K=V, entries and indexer keys.

`kv_cache_dtype`:
- "fp8_fp4" (default, the model's semantics and the release's cache formats): window K=V as e4m3 with a
  power-of-two (ue8m0) scale per 32 channels; compressed entries as e2m1 with an e4m3 scale per 16;
  indexer keys (and, in the forward, indexer queries) as e2m1 with a ue8m0 scale per 32. A vector whose
  width is not a multiple of its block stays unquantised, as in the reference.
- "bf16": no quantisation; the cache holds the model dtype (bf16 in deployments, float32 in the parity
  tests), which matches the reference with its QAT fake-quantisers off.

The model quantises a step's vectors once (`KvQuantizer`), uses the dequantised values, and the cache
stores the codes (`StoredTensor`); decoding them gives back exactly those values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = ["KvCacheDtype", "KV_CACHE_DTYPES", "KvFormat", "KvFormats", "kv_formats", "KvQuantizer", "StoredTensor"]

KvCacheDtype = Literal["fp8_fp4", "bf16"]
KV_CACHE_DTYPES: tuple[str, ...] = ("fp8_fp4", "bf16")

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class KvFormat:
    """kind "raw" (the model dtype), "fp8" (e4m3 + ue8m0 per block) or "fp4" (e2m1 + e4m3/ue8m0 per block)."""

    kind: Literal["raw", "fp8", "fp4"]
    block: int = 0
    scale_format: str = ""

    def part_specs(self, width: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(last-dim size, dtype) of each stored part of a width-`width` vector."""
        if self.kind == "raw":
            return [(width, dtype)]
        if self.kind == "fp8":
            return [(width, torch.float8_e4m3fn), (width // self.block, torch.uint8)]
        scale_dtype = torch.float8_e4m3fn if self.scale_format == "e4m3" else torch.uint8
        return [(width // 2, torch.uint8), (width // self.block, scale_dtype)]

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in self.part_specs(width, dtype))

    def encode(self, ops: KernelOps, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.kind == "raw":
            return (x,)
        if self.kind == "fp8":
            return ops.fp8_block_quantize(x, self.block)
        return ops.fp4_block_quantize(x, self.block, self.scale_format)

    def store(self, ops: KernelOps, x: torch.Tensor, parts: tuple[torch.Tensor, ...], rows: torch.Tensor) -> None:
        """Encode x [N, width] into vectors `rows` [N] (distinct) of the parts flattened over their leading dims."""
        if self.kind == "raw":
            parts[0].view(-1, parts[0].shape[-1])[rows] = x.to(parts[0].dtype)
        elif self.kind == "fp8":
            ops.fp8_block_quantize(x, self.block, out=parts, rows=rows)
        else:
            ops.fp4_block_quantize(x, self.block, self.scale_format, out=parts, rows=rows)

    def decode(
        self, ops: KernelOps, parts: tuple[torch.Tensor, ...], dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The vectors' values; with `rows`, only those vectors of the parts flattened over their leading dims."""
        if self.kind == "raw":
            vectors = parts[0] if rows is None else parts[0].reshape(-1, parts[0].shape[-1])[rows]
            return vectors.to(dtype)
        if self.kind == "fp8":
            return ops.fp8_block_dequantize(*parts, dtype, rows=rows)
        return ops.fp4_block_dequantize(*parts, dtype, rows=rows)


RAW = KvFormat("raw")


@dataclass(frozen=True, slots=True)
class KvFormats:
    window: KvFormat
    entry: KvFormat
    index: KvFormat


def kv_formats(head_dim: int, index_head_dim: int, kv_cache_dtype: str) -> KvFormats:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "bf16":
        return KvFormats(RAW, RAW, RAW)
    return KvFormats(
        KvFormat("fp8", 32) if head_dim % 32 == 0 else RAW,
        KvFormat("fp4", 16, "e4m3") if head_dim % 16 == 0 else RAW,
        KvFormat("fp4", 32, "ue8m0") if index_head_dim % 32 == 0 else RAW,
    )


class KvQuantizer:
    """The formats applied to a step's vectors: returns what the cache will hold, dequantised."""

    def __init__(self, ops: KernelOps, formats: KvFormats) -> None:
        self.ops, self.formats = ops, formats

    def window(self, kv: torch.Tensor) -> torch.Tensor:
        """Window K=V [..., head_dim]."""
        return self._roundtrip(self.formats.window, kv)

    def entry(self, latent: torch.Tensor) -> torch.Tensor:
        """A compressed entry [..., head_dim], after RoPE."""
        return self._roundtrip(self.formats.entry, latent)

    def index(self, x: torch.Tensor) -> torch.Tensor:
        """An indexer key or query [..., index_head_dim], after RoPE."""
        return self._roundtrip(self.formats.index, x)

    def _roundtrip(self, fmt: KvFormat, x: torch.Tensor) -> torch.Tensor:
        if fmt.kind == "raw":
            return x
        return fmt.decode(self.ops, fmt.encode(self.ops, x), x.dtype)


class StoredTensor:
    """A [*leading, width] tensor kept in a KvFormat: one storage tensor per part, same leading dims."""

    __slots__ = ("fmt", "parts", "dtype")

    def __init__(self, fmt: KvFormat, leading: tuple[int, ...], width: int, dtype: torch.dtype, allocate: Allocate):
        self.fmt, self.dtype = fmt, dtype
        self.parts = tuple(allocate((*leading, n), d) for n, d in fmt.part_specs(width, dtype))

    def read(self, ops: KernelOps, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Decoded values at `index` (advanced indexing over the leading dims), read where they lie: the
        decode gathers the vectors itself (a paged read's gather of each part first cost one slow torch
        index kernel a part, and a copy)."""
        return self.read_rows(ops, self.rows(index))

    def read_rows(self, ops: KernelOps, rows: torch.Tensor) -> torch.Tensor:
        """Decoded values of the vectors `rows` (flat ids over the leading dims, as `rows(index)` gives them)."""
        return self.fmt.decode(ops, self.parts, self.dtype, rows=rows)

    def rows(self, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The flat vector ids that `part[index]` would read, in its result's shape (minus the width)."""
        leading = self.parts[0].shape[:-1]
        rows = None
        for dim, ids in enumerate(index):
            stride = math.prod(leading[dim + 1:])
            term = ids if stride == 1 else ids * stride
            rows = term if rows is None else rows + term
        rest = leading[len(index):]
        if rest:  # dims the index leaves whole come after the indexed ones, in order
            rows = (rows.unsqueeze(-1) + torch.arange(math.prod(rest), device=rows.device)).view(*rows.shape, *rest)
        return rows

    def write(self, ops: KernelOps, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
        """Store `values` at `index` (advanced indexing over the leading dims, one vector a position)."""
        self.write_rows(ops, self.rows(index), values)

    def write_rows(self, ops: KernelOps, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values` [*rows.shape, width] as the vectors `rows` (distinct flat ids, as `rows(index)` gives
        them), encoded where they lie: one launch, where an encode and an index write a part took three."""
        self.fmt.store(ops, values.reshape(-1, values.shape[-1]), self.parts, rows.reshape(-1))
