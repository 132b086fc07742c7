"""The `ascend` backend: Ascend NPUs through torch_npu, HCCL collectives, NPU memory and graphs.

Until Ascend kernels land, the ops are the reference `KernelOps` running on the NPU. Nothing here
runs in CI (no NPU, no torch_npu); `check()` explains what is missing.
"""

from __future__ import annotations

from typing import Any

from deepinfer_ascend.device_check import NpuDeviceInfo, probe_npu
from deepinfer_ascend.npu_memory import NpuMemoryManager
from deepinfer_core.platform.distributed_communicator import DistributedCommunicator
from deepinfer_core.platform.interfaces import Backend, Capabilities
from deepinfer_core.platform.kernel_ops import KernelOps

__all__ = ["AscendBackend"]


class AscendBackend(Backend):
    name = "ascend"
    device_type = "npu"
    priority = 90
    distributed_backend = "hccl"

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        self._info: NpuDeviceInfo | None = None

    def check(self) -> None:
        self._info = probe_npu(self.device_index)

    def describe(self) -> dict[str, str]:
        info = self._info or probe_npu(self.device_index)
        return {
            "device": f"{self.device_type}:{self.device_index} {info.name}",
            "CANN": info.cann,
            "torch_npu": info.torch_npu,
        }

    def ops(self) -> KernelOps:
        return KernelOps()

    def communicator(self, group: Any = None) -> DistributedCommunicator:
        return DistributedCommunicator(group, self.distributed_backend)

    def memory(self) -> NpuMemoryManager:
        return NpuMemoryManager(self.device)

    def capabilities(self) -> Capabilities:
        # Reference ops on the NPU: no batch-invariant kernels yet, fp8/fp4 dequantised.
        return Capabilities(
            batch_invariant=False, deterministic_sampling=True, graphs=True, fp8=False, fp4=False
        )
