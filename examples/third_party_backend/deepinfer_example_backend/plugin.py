"""Entry point: only says where the backend lives, so listing backends imports nothing heavy."""

from __future__ import annotations

from deepinfer_core.platform import BackendRecord, hookimpl

__all__ = ["deepinfer_backend"]


@hookimpl
def deepinfer_backend() -> BackendRecord:
    return BackendRecord(
        name="example",
        factory="deepinfer_example_backend.backend:ExampleBackend",
        # Below the built-in cpu backend (0): `auto` never picks a template over the reference.
        priority=-10,
        install="pip install ./examples/third_party_backend",
    )
