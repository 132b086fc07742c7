"""`MemoryManager` of one Ascend NPU, on torch_npu's `torch.npu` API (streams, events, NPU graphs).

Written against torch_npu's documented API and not run in this repository's CI, which has no NPU;
it is exercised only on Ascend hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from deepinfer_ascend.device_check import import_torch_npu
from deepinfer_core.platform.interfaces import MemoryInfo, MemoryManager

__all__ = ["NpuGraph", "NpuMemoryManager"]


@dataclass(slots=True)
class NpuGraph:
    graph: Any
    output: Any

    def replay(self) -> None:
        self.graph.replay()


class NpuMemoryManager(MemoryManager):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._npu: ModuleType = import_torch_npu().npu

    def memory_info(self) -> MemoryInfo:
        free, total = self._npu.mem_get_info(self.device)
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def pinned_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def new_stream(self) -> Any:
        return self._npu.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self._npu.current_stream(self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self._npu.stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        return self._npu.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        self._npu.synchronize(self.device)

    @property
    def supports_graphs(self) -> bool:
        return True

    def capture_graph(self, fn: Callable[[], Any], warmup_iters: int = 2) -> NpuGraph:
        # Same protocol as other graph runtimes: warm up on a side stream so lazy initialisation
        # stays out of the capture, then capture one call.
        current = self._npu.current_stream(self.device)
        side = self._npu.Stream(device=self.device)
        side.wait_stream(current)
        with self._npu.stream(side):
            for _ in range(warmup_iters):
                fn()
        current.wait_stream(side)
        graph = self._npu.NPUGraph()
        with self._npu.graph(graph):
            output = fn()
        return NpuGraph(graph, output)
