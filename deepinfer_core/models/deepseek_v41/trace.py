"""Optional per-layer record of a forward (router / indexer picks, residual streams) for parity tests."""

from __future__ import annotations

import torch

__all__ = ["Trace"]


class Trace:
    """Inactive unless `start()` was called; `record` then keeps a CPU copy under `name`."""

    def __init__(self) -> None:
        self.records: dict[str, torch.Tensor] | None = None

    def start(self) -> None:
        self.records = {}

    def stop(self) -> dict[str, torch.Tensor]:
        records, self.records = self.records or {}, None
        return records

    def record(self, name: str, value: torch.Tensor) -> None:
        if self.records is not None:
            self.records[name] = value.detach().to("cpu", copy=True)
