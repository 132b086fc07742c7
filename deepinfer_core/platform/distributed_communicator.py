"""`Communicator` on `torch.distributed`, shared by every backend.

The collectives are the same calls on every accelerator; what differs is the process group's
backend string (gloo, or the vendor's library), which each `Backend` names in
`distributed_backend` and this class verifies, so a group set up for the wrong device fails here
with a clear message instead of deep inside a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.platform.errors import BackendError
from deepinfer_core.platform.interfaces import Communicator, ReduceOp

__all__ = ["CommunicatorSetupError", "DistributedCommunicator"]

# NOTE: torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names;
# older torch (e.g. the 2.11 CUDA builds) only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CommunicatorSetupError(BackendError):
    """The process group is missing or was initialised for another accelerator."""


def _reduce_op(op: ReduceOp) -> dist.ReduceOp:
    # "avg" is summed then divided: not every library has a native average (gloo has none).
    try:
        return _REDUCE_OPS["sum" if op == "avg" else op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}: expected one of sum, max, min, avg") from None


class DistributedCommunicator(Communicator):
    """Collectives over a `torch.distributed` process group initialised with `expected_backend`."""

    def __init__(self, group: Any, expected_backend: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicatorSetupError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group("
                f"backend={expected_backend!r}, ...) (or launch with torchrun) before asking the "
                "backend for a communicator"
            )
        # A group may pair one backend per device type, e.g. "cpu:gloo,<device>:<library>".
        found = str(dist.get_backend(group))
        if expected_backend not in found:
            raise CommunicatorSetupError(
                f"the process group uses the {found!r} backend but this accelerator needs "
                f"{expected_backend!r}: initialise the group with backend={expected_backend!r}"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> None:
        dist.all_reduce(tensor, op=_reduce_op(op), group=self._group)
        if op == "avg":
            tensor.div_(self._world_size)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        moved = tensor.movedim(dim, 0).contiguous()
        out = moved.new_empty((self._world_size * moved.shape[0], *moved.shape[1:]))
        _all_gather_single(out, moved, group=self._group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: int = 0) -> torch.Tensor:
        size = tensor.shape[dim]
        if size % self._world_size:
            raise ValueError(
                f"reduce_scatter needs dim {dim} divisible by world_size {self._world_size}, "
                f"found size {size}"
            )
        moved = tensor.movedim(dim, 0).contiguous()
        out = moved.new_empty((size // self._world_size, *moved.shape[1:]))
        _reduce_scatter_single(out, moved, op=_reduce_op(op), group=self._group)
        if op == "avg":
            out.div_(self._world_size)
        return out.movedim(0, dim).contiguous()

    def all_to_all(
        self,
        tensor: torch.Tensor,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if len(input_split_sizes) != self._world_size or sum(input_split_sizes) != tensor.shape[0]:
            raise ValueError(
                f"input_split_sizes {list(input_split_sizes)} must have {self._world_size} entries "
                f"summing to the {tensor.shape[0]} rows of the tensor"
            )
        if output_split_sizes is None:
            output_split_sizes = self._exchange_counts(input_split_sizes, tensor.device)
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(output_split_sizes), *tensor.shape[1:]))
        dist.all_to_all_single(
            out, tensor, list(output_split_sizes), list(input_split_sizes), group=self._group
        )
        return out

    def _exchange_counts(self, input_split_sizes: Sequence[int], device: torch.device) -> list[int]:
        send = torch.tensor(list(input_split_sizes), dtype=torch.int64, device=device)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self._group)
        return received.tolist()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        # torch.distributed takes a global rank; `src` is a rank within this group.
        global_src = src if self._group is None else dist.get_global_rank(self._group, src)
        dist.broadcast(tensor, src=global_src, group=self._group)

    def barrier(self) -> None:
        dist.barrier(group=self._group)
