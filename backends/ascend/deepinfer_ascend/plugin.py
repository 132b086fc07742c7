"""Entry point of the `ascend` backend: registers it without importing torch_npu."""

from __future__ import annotations

from deepinfer_core.platform.hookspecs import BackendRecord, hookimpl

__all__ = ["deepinfer_backend"]


@hookimpl
def deepinfer_backend() -> BackendRecord:
    return BackendRecord(
        name="ascend",
        factory="deepinfer_ascend.backend:AscendBackend",
        priority=90,
        install="DEEPINFER_ACCELERATOR=ascend ./build.sh (the deepinfer[ascend] extra)",
    )
