"""The contracts a backend implements: `Backend`, `Communicator`, `MemoryManager`, `Capabilities`.

`KernelOps` (the compute contract, with its plain-torch reference) lives in `kernel_ops.py` and is
re-exported here so a backend author imports every contract from one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from deepinfer_core.platform.errors import (
    BackendError,
    BackendUnavailable,
    DuplicateBackend,
    GraphCaptureUnsupported,
    InvalidBackendPlugin,
    UnknownBackend,
)
from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Capabilities",
    "Communicator",
    "DeviceGraph",
    "DuplicateBackend",
    "Event",
    "GraphCaptureUnsupported",
    "InvalidBackendPlugin",
    "KernelOps",
    "MemoryInfo",
    "MemoryManager",
    "ReduceOp",
    "Stream",
    "UnknownBackend",
]

ReduceOp = str
"""Reduction name for collectives: "sum", "max", "min" or "avg"."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can honestly promise; the engine refuses modes a backend lacks.

    batch_invariant: every op's reduction order is independent of batch size and of a row's
        position in the batch, so one request's logits are bitwise equal alone or in any batch.
    deterministic_sampling: seeded sampling gives the same tokens on every run.
    graphs: `MemoryManager.capture_graph` works (whole-step capture and replay).
    fp8: fp8 (e4m3, block-scaled) weights run natively instead of being dequantised to bf16.
    fp4: fp4 expert weights run natively.
    """

    batch_invariant: bool
    deterministic_sampling: bool
    graphs: bool
    fp8: bool
    fp4: bool


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory in bytes, as the driver reports it (free includes memory torch caches)."""

    free_bytes: int
    total_bytes: int


@runtime_checkable
class Event(Protocol):
    """A point in a stream's work. torch's device event classes satisfy it."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event's record to `end_event`'s; both were created with
        `enable_timing=True` and have completed."""
        ...


@runtime_checkable
class Stream(Protocol):
    """An ordered queue of device work. torch's device stream classes satisfy it."""

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceGraph(Protocol):
    """A captured sequence of device work; `replay()` reruns it on the tensors it captured.

    `output` is whatever the captured callable returned; replay refreshes it in place, so callers
    write new inputs into the captured input tensors and read `output` after `replay()`.
    """

    output: Any

    def replay(self) -> None: ...


class Communicator(ABC):
    """Collectives over one process group, on tensors that live on the backend's device.

    Every rank of the group must call the same collectives in the same order with tensors of
    matching shape and dtype (except where split sizes say otherwise). `dim` arguments are the
    dimension that is concatenated or split; tensors must be contiguous.
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank within the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> None:
        """Reduce `tensor` over all ranks, in place: afterwards every rank holds the result."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` in rank order; returns a new tensor
        whose size along `dim` is world_size times the input's."""

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: int = 0) -> torch.Tensor:
        """Reduce `tensor` over all ranks and return this rank's chunk along `dim`.

        The size along `dim` must be divisible by world_size; the result is 1/world_size of it.
        """

    @abstractmethod
    def all_to_all(
        self,
        tensor: torch.Tensor,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Exchange rows (dim 0) between ranks: row block i of `tensor` goes to rank i.

        input_split_sizes[i] rows are sent to rank i (they sum to tensor.shape[0]). The result
        concatenates the blocks received from ranks 0..world_size-1. output_split_sizes, when the
        caller already knows them, saves the exchange of counts; when None they are exchanged
        first. This is EP dispatch/combine: the splits vary per step.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite `tensor` on every rank with rank `src`'s, in place."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has reached this call."""


class MemoryManager(ABC):
    """Device memory, host staging buffers, streams, events and graph capture of one device."""

    device: torch.device

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor of `shape` and `dtype` with undefined contents (the paged KV pools)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    @abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Free and total memory of the device."""

    @abstractmethod
    def pinned_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that the device copies from and to asynchronously (page-locked where the
        device has such memory), contents undefined."""

    @abstractmethod
    def new_stream(self) -> Stream:
        """A new stream of this device, for work that overlaps the current stream's."""

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream ops are queued on right now."""

    @abstractmethod
    def use_stream(self, stream: Stream) -> AbstractContextManager[Stream]:
        """Context in which ops are queued on `stream`."""

    @abstractmethod
    def new_event(self, enable_timing: bool = False) -> Event:
        """A new event; `enable_timing` allows measuring time between two recorded events."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until every queued op of the device has finished."""

    @property
    @abstractmethod
    def supports_graphs(self) -> bool:
        """Whether `capture_graph` works on this device."""

    @abstractmethod
    def capture_graph(self, fn: Callable[[], Any], warmup_iters: int = 2) -> DeviceGraph:
        """Run `fn` `warmup_iters` times, then capture one call of it into a replayable graph.

        `fn` must only touch tensors that stay alive (and keep their addresses) while the graph
        is replayed. Graphs of one manager may share scratch memory: replay them one at a time, in
        stream order. Raises `GraphCaptureUnsupported` where `supports_graphs` is False.
        """


class Backend(ABC):
    """One accelerator: hands out its ops, collectives and memory manager.

    Construction must be cheap and must not import the vendor stack's device runtime beyond what
    `check()` needs; `check()` says whether this machine can run the backend. `select_backend`
    only returns a backend whose `check()` passed.
    """

    name: ClassVar[str]
    """Registry name, the value of DEEPINFER_ACCELERATOR that selects it."""
    device_type: ClassVar[str]
    """torch device type of its tensors: "cpu", "cuda", "npu", ..."""
    priority: ClassVar[int]
    """Rank among available backends when DEEPINFER_ACCELERATOR is `auto` (higher wins)."""
    distributed_backend: ClassVar[str]
    """torch.distributed backend string for `init_process_group` on this accelerator."""

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index

    @property
    def device(self) -> torch.device:
        """The device every tensor of this backend lives on."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_index)

    @abstractmethod
    def check(self) -> None:
        """Return when this machine can run the backend; otherwise raise `BackendUnavailable`
        whose message names what is missing and how to get it."""

    def describe(self) -> dict[str, str]:
        """Facts about the device for `deepinfer backends` (name, compute capability, versions).

        Only called after `check()` passed.
        """
        return {"device": str(self.device)}

    @abstractmethod
    def ops(self) -> KernelOps:
        """The kernel ops of this backend (a `KernelOps` subclass instance)."""

    @abstractmethod
    def communicator(self, group: Any = None) -> Communicator:
        """Collectives over `group` (a torch.distributed process group; None = the default
        group), which must have been initialised with `distributed_backend`."""

    @abstractmethod
    def memory(self) -> MemoryManager:
        """The memory manager of `device`."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports, honestly."""
