"""Batch-invariant execution of per-row ops: every call on a fixed number of rows.

A row's bits may depend on the *shape* of the call that computes it (BLAS picks kernels and K
blockings by row count, a reduction splits its work by the number of outputs, a vectorised loop
finishes a tensor with a scalar tail), but not on the other rows' values. Running an op on tiles
of exactly `tile` rows, the last tile padded by repeating its last row, gives every call the same
shape, so a row's result no longer depends on how many rows the batch has. `tile` is a multiple of
16 so that every tile's flat length is a whole number of SIMD vectors (no scalar tail).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["in_row_tiles", "row_tiled"]

Output = torch.Tensor | tuple[torch.Tensor, ...]


def in_row_tiles(fn: Callable[..., Output], rows: Sequence[torch.Tensor | None], tile: int) -> Output:
    """fn(*rows) computed tile by tile; `rows` share their leading (token) dim, None passes through.

    fn must treat rows independently and return a tensor or a tuple of tensors with that leading dim.
    """
    present = [r for r in rows if r is not None]
    count = present[0].shape[0]
    if count == 0:
        return fn(*rows)
    padded_count = -(-count // tile) * tile
    padded = [None if r is None else _pad_rows(r, padded_count) for r in rows]
    outs = [fn(*(None if r is None else r[s:s + tile] for r in padded)) for s in range(0, padded_count, tile)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:count] for parts in zip(*outs))
    return torch.cat(outs)[:count]


def row_tiled(*row_args: str) -> Callable:
    """Decorate a `KernelOps` method whose arguments `row_args` (and outputs) are row-aligned: when the
    ops object is in batch-invariant mode, the method runs on `ops.row_tile`-row tiles."""

    def decorate(op: Callable) -> Callable:
        signature = inspect.signature(op)

        @functools.wraps(op)
        def tiled(self: Any, *args: Any, **kwargs: Any) -> Output:
            if not self.batch_invariant:
                return op(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)

            def on_tile(*tiles: torch.Tensor | None) -> Output:
                call = dict(bound.arguments)
                call.update(zip(row_args, tiles))
                return op(**call)

            return in_row_tiles(on_tile, [bound.arguments.get(name) for name in row_args], self.row_tile)

        return tiled

    return decorate



def _pad_rows(t: torch.Tensor, count: int) -> torch.Tensor:
    if t.shape[0] == count:
        return t
    return torch.cat([t, t[-1:].expand(count - t.shape[0], *t.shape[1:])])
