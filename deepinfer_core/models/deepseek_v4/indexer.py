"""Lightning indexer of CSA layers: picks each query's top-k compressed entries."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.forward_batch import ForwardBatch

from .cache import CompressorState
from .compressor import Compressor
from .factory import ModuleFactory

__all__ = ["Indexer"]


class Indexer(nn.Module):
    def __init__(self, f: ModuleFactory, ratio: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.ratio, self.topk = f.ops, ratio, c.index_topk
        self.n_heads, self.head_dim = c.index_n_heads, c.index_head_dim
        self.wq_b = f.linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, quantizable=True)
        self.weights_proj = f.linear(c.hidden_size, c.index_n_heads, quantizable=False)
        self.compressor = Compressor(f, ratio, c.index_head_dim, overlap=True)

    def forward(
        self,
        head_weights: torch.Tensor,
        q_latent: torch.Tensor,
        inv_freq: torch.Tensor,
        batch: ForwardBatch,
        state: CompressorState,
    ) -> torch.Tensor:
        """[T, index_topk] int64 entry ids per query, -1 padded. `head_weights` is `weights_proj` of the
        block input, which the attention projects with its own projections of it (one launch); `state`
        already holds this step's index keys (the attention runs `compressor` first)."""
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        q = self.ops.rope(q, batch.positions, inv_freq, inplace=True)
        return self.ops.indexer_topk(q, head_weights, state.entries, self.ratio, self.topk, batch)
