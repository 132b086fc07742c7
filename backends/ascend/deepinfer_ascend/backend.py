"""The `ascend` backend: Ascend NPUs through torch_npu, HCCL collectives, NPU memory and graphs.

The ops are `AscendOps` (`ops.py`): the reference `KernelOps` on the NPU with the ops torch_npu has
a documented fused operator for replaced by it. Nothing here runs in CI (no NPU, no torch_npu);
`check()` explains what is missing and `scripts/check_ascend.py` is the proof to run on hardware.
"""

from __future__ import annotations

from typing import Any

from deepinfer_ascend.device_check import NpuDeviceInfo, import_torch_npu, probe_npu
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
        from deepinfer_ascend.ops import AscendOps

        return AscendOps(import_torch_npu())

    def communicator(self, group: Any = None) -> DistributedCommunicator:
        return DistributedCommunicator(group, self.distributed_backend)

    def memory(self) -> NpuMemoryManager:
        return NpuMemoryManager(self.device)

    def capabilities(self) -> Capabilities:
        # Nothing is claimed that has not been proven on an NPU. batch_invariant: the fused
        # operators and matmuls tile by shape. deterministic_sampling: the sampler is the reference
        # (counter-based, pure integer ops), but run-to-run identical logits are unproven on Ascend.
        # graphs: torch_npu documents NPUGraph capture/replay (torch_npu.npu.NPUGraph, aclnn ops only).
        # fp8/fp4: no torch_npu page documents a matmul on e4m3 weights with DeepSeek's 128x128
        # e8m0 block scales, so quantised weights are dequantised by the reference ops.
        return Capabilities(
            batch_invariant=False, deterministic_sampling=False, graphs=True, fp8=False, fp4=False
        )
