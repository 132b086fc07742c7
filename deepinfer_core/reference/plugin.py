"""Entry point of the built-in `cpu` backend (group `deepinfer.backends`, like every backend)."""

from __future__ import annotations

from deepinfer_core.platform.hookspecs import BackendRecord, hookimpl

__all__ = ["deepinfer_backend"]


@hookimpl
def deepinfer_backend() -> BackendRecord:
    return BackendRecord(
        name="cpu",
        factory="deepinfer_core.reference.backend:CpuBackend",
        priority=0,
        install="pip install deepinfer",
    )
