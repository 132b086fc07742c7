"""The platform layer: the contracts backends implement and the registry that selects one."""

from deepinfer_core.platform.conformance import ConformanceReport, run_conformance
from deepinfer_core.platform.hookspecs import BackendRecord, hookimpl
from deepinfer_core.platform.interfaces import (
    Backend,
    BackendError,
    BackendUnavailable,
    Capabilities,
    Communicator,
    KernelOps,
    MemoryInfo,
    MemoryManager,
    UnknownBackend,
)
from deepinfer_core.platform.registry import BackendRegistry, select_backend

__all__ = [
    "Backend",
    "BackendError",
    "BackendRecord",
    "BackendRegistry",
    "BackendUnavailable",
    "Capabilities",
    "Communicator",
    "ConformanceReport",
    "KernelOps",
    "MemoryInfo",
    "MemoryManager",
    "UnknownBackend",
    "hookimpl",
    "run_conformance",
    "select_backend",
]
