"""`MemoryManager` of one CUDA device: caching-allocator tensors, pinned host memory, CUDA
streams/events and CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.platform.interfaces import MemoryInfo, MemoryManager

__all__ = ["CudaGraph", "CudaMemoryManager"]


@dataclass(slots=True)
class CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: Any

    def replay(self) -> None:
        self.graph.replay()


class CudaMemoryManager(MemoryManager):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graph_pool = None  # one memory pool for every graph this manager captures

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def pinned_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[torch.cuda.Stream]:
        return torch.cuda.stream(stream)

    def new_event(self, enable_timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @property
    def supports_graphs(self) -> bool:
        return True

    def capture_graph(self, fn: Callable[[], Any], warmup_iters: int = 2) -> CudaGraph:
        # Warm up on a side stream, as capture requires: lazy initialisation (cuBLAS handles,
        # Triton autotuning, allocator growth) must not happen inside the capture.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup_iters):
                fn()
        current.wait_stream(side)
        # Graphs share one pool (they replay one at a time on one stream), so a graph per decode batch
        # size and context bound costs the largest one's scratch memory, not the sum.
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            output = fn()
        return CudaGraph(graph, output)
