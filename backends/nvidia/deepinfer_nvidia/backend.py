"""The `nvidia` backend: CUDA devices, NCCL collectives, CUDA memory and graphs.

The ops are `TritonOps` (`ops.py`): the reference `KernelOps` on the GPU with its hot ops replaced
by the Triton kernels of `deepinfer_kernels`.
"""

from __future__ import annotations

from typing import Any

from deepinfer_core.platform.distributed_communicator import DistributedCommunicator
from deepinfer_core.platform.interfaces import Backend, Capabilities
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_nvidia.cuda_memory import CudaMemoryManager
from deepinfer_nvidia.device_check import CudaDeviceInfo, probe_cuda

__all__ = ["NvidiaBackend"]


class NvidiaBackend(Backend):
    name = "nvidia"
    device_type = "cuda"
    priority = 100
    distributed_backend = "nccl"

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        self._info: CudaDeviceInfo | None = None

    def check(self) -> None:
        self._info = probe_cuda(self.device_index)

    def describe(self) -> dict[str, str]:
        info = self._info or probe_cuda(self.device_index)
        return {
            "device": f"{self.device} {info.name}",
            "compute capability": f"{info.capability[0]}.{info.capability[1]} ({info.support})",
            "memory": f"{info.total_bytes / 2**30:.1f} GiB",
            "CUDA": f"driver {info.driver_cuda[0]}.{info.driver_cuda[1]}, torch built for "
            f"{info.torch_cuda}, cuda-python {info.cuda_python}",
        }

    def ops(self) -> KernelOps:
        from deepinfer_nvidia.ops import TritonOps

        return TritonOps()

    def communicator(self, group: Any = None) -> DistributedCommunicator:
        return DistributedCommunicator(group, self.distributed_backend)

    def memory(self) -> CudaMemoryManager:
        return CudaMemoryManager(self.device)

    def capabilities(self) -> Capabilities:
        # batch_invariant: TritonOps' mode with fixed tiles and reduction orders (ops.py);
        # fp8/fp4 weights are dequantised by the reference ops.
        return Capabilities(
            batch_invariant=True, deterministic_sampling=True, graphs=True, fp8=False, fp4=False
        )
