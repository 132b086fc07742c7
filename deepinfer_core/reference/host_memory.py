"""`MemoryManager` of the host: plain CPU tensors, and streams and events that order nothing.

CPU ops run synchronously in program order, so a stream has nothing to queue and an event is
complete the moment it is recorded; these objects exist so the engine's overlap logic runs
unchanged on the `cpu` backend.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from deepinfer_core.platform.errors import GraphCaptureUnsupported
from deepinfer_core.platform.interfaces import DeviceGraph, MemoryInfo, MemoryManager

__all__ = ["HostEvent", "HostMemoryManager", "HostStream"]


class HostEvent:
    """An event of synchronous execution: complete once recorded; timed when asked to be."""

    def __init__(self, enable_timing: bool = False) -> None:
        self._enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        if self._enable_timing:
            self._recorded_at = time.perf_counter()

    def elapsed_time(self, end_event: HostEvent) -> float:
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError(
                "elapsed_time needs two events created with enable_timing=True and both recorded"
            )
        return (end_event._recorded_at - self._recorded_at) * 1000.0

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostStream:
    """A stream of synchronous execution: everything queued on it has already run."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event if event is not None else HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostMemoryManager(MemoryManager):
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._stream = HostStream()

    def memory_info(self) -> MemoryInfo:
        # NOTE: available pages exclude the reclaimable page cache, so "free" errs low: safe for
        # sizing the KV pools.
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page,
            total_bytes=os.sysconf("SC_PHYS_PAGES") * page,
        )

    def pinned_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def new_stream(self) -> HostStream:
        return HostStream()

    def current_stream(self) -> HostStream:
        return self._stream

    @contextmanager
    def use_stream(self, stream: HostStream) -> Iterator[HostStream]:
        yield stream

    def new_event(self, enable_timing: bool = False) -> HostEvent:
        return HostEvent(enable_timing)

    def synchronize(self) -> None:
        pass

    @property
    def supports_graphs(self) -> bool:
        return False

    def capture_graph(self, fn: Callable[[], Any], warmup_iters: int = 2) -> DeviceGraph:
        raise GraphCaptureUnsupported(
            "the cpu backend has no graph capture (capabilities().graphs is False): run the step "
            "eagerly, or select a backend whose capabilities report graphs"
        )
