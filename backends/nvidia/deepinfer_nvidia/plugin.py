"""Entry point of the `nvidia` backend: registers it without importing CUDA."""

from __future__ import annotations

from deepinfer_core.platform.hookspecs import BackendRecord, hookimpl

__all__ = ["deepinfer_backend"]


@hookimpl
def deepinfer_backend() -> BackendRecord:
    return BackendRecord(
        name="nvidia",
        factory="deepinfer_nvidia.backend:NvidiaBackend",
        priority=100,
        install="DEEPINFER_ACCELERATOR=nvidia ./build.sh (the deepinfer[nvidia] extra)",
    )
