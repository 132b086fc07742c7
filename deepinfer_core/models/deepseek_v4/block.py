"""One decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.model_config import LayerSpec
from deepinfer_core.models.forward_batch import ForwardBatch

from .attention import Attention
from .cache import LayerCache
from .factory import ModuleFactory
from .moe import MoE

__all__ = ["Block"]


class Block(nn.Module):
    def __init__(self, f: ModuleFactory, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.config = f.ops, c
        mix, flat = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        self.hc_attn_fn = f.param(mix, flat, dtype=torch.float32)
        self.hc_attn_base = f.param(mix, dtype=torch.float32)
        self.hc_attn_scale = f.param(3, dtype=torch.float32)
        self.hc_ffn_fn = f.param(mix, flat, dtype=torch.float32)
        self.hc_ffn_base = f.param(mix, dtype=torch.float32)
        self.hc_ffn_scale = f.param(3, dtype=torch.float32)
        self.attn_norm = f.norm(c.hidden_size)
        self.ffn_norm = f.norm(c.hidden_size)
        self.attn = Attention(f, spec)
        self.ffn = MoE(f, spec, layer_idx)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> torch.Tensor:
        """streams [T, hc_mult, D] -> [T, hc_mult, D]; `input_ids` feed hash routing."""
        ops, c = self.ops, self.config
        hc = (c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        norm = self.attn_norm
        attn_in, post, comb = ops.hc_pre_norm(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *hc, norm.weight, norm.eps
        )
        streams, pre, post, comb = ops.hc_update_mix(
            self.attn(attn_in, batch, cache), streams, post, comb, self.hc_ffn_fn, self.hc_ffn_base,
            self.hc_ffn_scale, *hc,
        )
        norm = self.ffn_norm
        ffn_in = ops.hc_collapse_norm(streams, pre, norm.weight, norm.eps)
        return ops.hc_post(self.ffn(ffn_in, input_ids), streams, post, comb)
