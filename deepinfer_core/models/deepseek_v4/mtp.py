"""The MTP (next-n) block: predicts token t+2 from row t's final streams and the embedding of token t+1.

z = e_proj(enorm(embed[next_token])) (broadcast over streams) + h_proj(hnorm(streams)) (per stream);
z goes through a full block (sliding attention, score-routed MoE) and its own hyper-head and norm.
"""

from __future__ import annotations

import torch

from deepinfer_core.model_config import LayerSpec
from deepinfer_core.models.forward_batch import ForwardBatch

from .block import Block
from .cache import LayerCache
from .factory import ModuleFactory

__all__ = ["MTPBlock"]


class MTPBlock(Block):
    def __init__(self, f: ModuleFactory, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__(f, spec, layer_idx)
        c = f.config
        self.e_proj = f.linear(c.hidden_size, c.hidden_size, quantizable=True)
        self.h_proj = f.linear(c.hidden_size, c.hidden_size, quantizable=True)
        self.enorm = f.norm(c.hidden_size)
        self.hnorm = f.norm(c.hidden_size)
        self.norm = f.norm(c.hidden_size)
        self.hc_head_fn = f.param(c.hc_mult, c.hc_mult * c.hidden_size, dtype=torch.float32)
        self.hc_head_base = f.param(c.hc_mult, dtype=torch.float32)
        self.hc_head_scale = f.param(1, dtype=torch.float32)

    def draft(
        self,
        streams: torch.Tensor,
        next_embeds: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output streams [N, hc_mult, D], normalised hidden [N, D] for the shared head)."""
        c = self.config
        z = self.e_proj(self.enorm(next_embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        out = self(z, next_token_ids, batch, cache)
        head = self.ops.hc_head(out, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, c.hc_eps)
        return out, self.norm(head)
