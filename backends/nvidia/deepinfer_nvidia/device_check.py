"""What `NvidiaBackend.check()` verifies: a CUDA 13 torch, cuda-python, a CUDA 13 driver, a GPU.

Decision on older CUDA: a torch built for CUDA 12 is rejected even though it could run on a CUDA 13
driver, because the process also loads cuda-python 13 and the Triton kernels, and two CUDA runtime
majors in one process is a configuration nobody tests. The message says how to get a CUDA 13 torch.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import torch

from deepinfer_core.platform.errors import BackendUnavailable

__all__ = ["CudaDeviceInfo", "MIN_CAPABILITY", "MIN_CUDA", "TUNED_CAPABILITY", "probe_cuda"]

MIN_CUDA = (13, 0)
MIN_CAPABILITY = (9, 0)
TUNED_CAPABILITY = (10, 0)

_CUDA13_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cu130"


@dataclass(frozen=True, slots=True)
class CudaDeviceInfo:
    name: str
    capability: tuple[int, int]
    total_bytes: int
    driver_cuda: tuple[int, int]
    torch_cuda: str
    cuda_python: str

    @property
    def support(self) -> str:
        sm = f"sm_{self.capability[0]}{self.capability[1]}"
        if self.capability == TUNED_CAPABILITY:
            return f"{sm}: the tuned target"
        if self.capability == MIN_CAPABILITY:
            return f"{sm}: supported (Hopper); kernels are tuned for sm_100"
        return f"{sm}: accepted, not tuned (kernels are tuned for sm_100)"


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int(minor)


def probe_cuda(device_index: int) -> CudaDeviceInfo:
    """Describe GPU `device_index`, or raise `BackendUnavailable` naming what is missing."""
    if torch.version.cuda is None:
        raise BackendUnavailable(
            f"torch {torch.__version__} is built without CUDA: install a CUDA 13 build of torch "
            f"({_CUDA13_TORCH})"
        )
    if _major_minor(torch.version.cuda) < MIN_CUDA:
        raise BackendUnavailable(
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda}; the nvidia backend "
            f"needs a torch built for CUDA 13 or newer ({_CUDA13_TORCH})"
        )
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise BackendUnavailable(
            f"cuda-python is not importable ({exc}): DEEPINFER_ACCELERATOR=nvidia ./build.sh installs "
            "it with the deepinfer[nvidia] extra (or pip install 'cuda-python>=13')"
        ) from exc
    error, driver = runtime.cudaDriverGetVersion()
    if error != runtime.cudaError_t.cudaSuccess or driver == 0:
        raise BackendUnavailable(
            f"no NVIDIA driver answered (cudaDriverGetVersion: {error}, version {driver}): install "
            "the NVIDIA driver and check that nvidia-smi lists a GPU"
        )
    driver_cuda = (driver // 1000, driver % 1000 // 10)
    if driver_cuda < MIN_CUDA:
        raise BackendUnavailable(
            f"the NVIDIA driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}; CUDA 13 needs a "
            "newer driver (R580 or later): update the driver"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise BackendUnavailable(
            "no CUDA GPU is visible (torch.cuda.device_count() is 0): check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES"
        )
    if device_index >= count:
        raise BackendUnavailable(f"GPU index {device_index} requested but only {count} GPU(s) are visible")
    try:
        capability = torch.cuda.get_device_capability(device_index)
        properties = torch.cuda.get_device_properties(device_index)
    except RuntimeError as exc:
        raise BackendUnavailable(
            f"GPU {device_index} is visible but cannot be initialised ({exc}): check nvidia-smi"
        ) from exc
    if capability < MIN_CAPABILITY:
        raise BackendUnavailable(
            f"{properties.name} has compute capability {capability[0]}.{capability[1]}; the "
            "nvidia backend needs sm_90 (Hopper) or newer, and is tuned for sm_100 (Blackwell)"
        )
    return CudaDeviceInfo(
        name=properties.name,
        capability=capability,
        total_bytes=properties.total_memory,
        driver_cuda=driver_cuda,
        torch_cuda=torch.version.cuda,
        cuda_python=_cuda_python_version(),
    )


def _cuda_python_version() -> str:
    # NOTE: images that ship only cuda-python's parts (cuda-bindings) lack the meta-distribution.
    for distribution in ("cuda-python", "cuda-bindings"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
