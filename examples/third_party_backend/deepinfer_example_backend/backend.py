"""The `example` backend: runs on the host, with `ExampleOps`, gloo and the host memory manager."""

from __future__ import annotations

from typing import Any

from deepinfer_core.platform import Backend, Capabilities, Communicator, MemoryManager
from deepinfer_core.platform.distributed_communicator import DistributedCommunicator
from deepinfer_core.reference.host_memory import HostMemoryManager
from deepinfer_example_backend.ops import ExampleOps

__all__ = ["ExampleBackend"]


class ExampleBackend(Backend):
    name = "example"
    device_type = "cpu"
    priority = -10
    distributed_backend = "gloo"

    def check(self) -> None:
        """A real backend raises BackendUnavailable here when its device or library is missing."""

    def ops(self) -> ExampleOps:
        return ExampleOps()

    def communicator(self, group: Any = None) -> Communicator:
        return DistributedCommunicator(group, self.distributed_backend)

    def memory(self) -> MemoryManager:
        return HostMemoryManager()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            batch_invariant=False, deterministic_sampling=True, graphs=False, fp8=False, fp4=False
        )
