"""The built-in `cpu` backend: reference ops, gloo collectives, host memory. Always available."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.platform.distributed_communicator import DistributedCommunicator
from deepinfer_core.platform.interfaces import Backend, Capabilities
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.reference.host_memory import HostMemoryManager

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    distributed_backend = "gloo"

    def check(self) -> None:
        """The host is always there."""

    def describe(self) -> dict[str, str]:
        return {"device": "cpu", "threads": str(torch.get_num_threads())}

    def ops(self) -> KernelOps:
        return KernelOps()

    def communicator(self, group: Any = None) -> DistributedCommunicator:
        return DistributedCommunicator(group, self.distributed_backend)

    def memory(self) -> HostMemoryManager:
        return HostMemoryManager()

    def capabilities(self) -> Capabilities:
        # Host execution is deterministic run to run; torch's CPU GEMMs choose kernels by row count,
        # which the reference ops' batch-invariant mode (fixed row tiles) takes out of the picture.
        # fp8/fp4 weights are dequantised by the reference ops, not run natively.
        return Capabilities(
            batch_invariant=True, deterministic_sampling=True, graphs=False, fp8=False, fp4=False
        )
