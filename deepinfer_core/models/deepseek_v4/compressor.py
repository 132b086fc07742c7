"""Gated pooling compressor: one compressed entry per `ratio` tokens (CSA with overlap, HCA without)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.forward_batch import ForwardBatch

from .cache import CompressorState
from .factory import ModuleFactory

__all__ = ["Compressor"]


class Compressor(nn.Module):
    def __init__(self, f: ModuleFactory, ratio: int, width: int, overlap: bool) -> None:
        super().__init__()
        self.ops, self.ratio, self.overlap = f.ops, ratio, overlap
        proj = 2 * width if overlap else width
        self.wkv = f.linear(f.config.hidden_size, proj, quantizable=False)
        self.wgate = f.linear(f.config.hidden_size, proj, quantizable=False)
        self.ape = f.param(ratio, proj, dtype=torch.float32)
        self.norm = f.norm(width)

    def forward(
        self, kv: torch.Tensor, gate: torch.Tensor, inv_freq: torch.Tensor, batch: ForwardBatch, state: CompressorState
    ) -> None:
        """Pools kv = x Wkv and gate = x Wgate [T, P] (the attention's `projections` form them) and emits this
        step's closed windows into `state.entries` (see `KernelOps.compress_kv`)."""
        self.ops.compress_kv(
            kv, gate, self.ape, self.norm.weight, self.norm.eps, inv_freq,
            self.ratio, self.overlap, state.state_kv, state.state_gate, state.entries, batch,
        )
