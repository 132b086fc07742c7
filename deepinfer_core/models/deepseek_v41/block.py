"""One V4.1 decoder layer with single-pass hyper-connections (MODEL_SPEC_V41 §3).

Each site computes (pre, post, comb) from its input streams, but collapses with the `pre` of the
site before it: attention with the previous layer's FFN `pre` (one-hot on stream 0 for layer 0), the
FFN with this layer's attention `pre`. The layer hands its FFN `pre` to the next one.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.forward_batch import ForwardBatch

from .attention import Attention, ForwardState
from .cache import DeepseekV41Cache
from .engram import Engram
from .factory import ModuleFactory
from .moe import MoE

__all__ = ["Block"]


class Block(nn.Module):
    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.config, self.trace, self.layer = f.ops, c, f.trace, layer
        mix, flat = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        self.hc_attn_fn = f.param(mix, flat, dtype=torch.float32)
        self.hc_attn_base = f.param(mix, dtype=torch.float32)
        self.hc_attn_scale = f.param(3, dtype=torch.float32)
        self.hc_ffn_fn = f.param(mix, flat, dtype=torch.float32)
        self.hc_ffn_base = f.param(mix, dtype=torch.float32)
        self.hc_ffn_scale = f.param(3, dtype=torch.float32)
        self.attn_norm = f.norm(c.hidden_size)
        self.ffn_norm = f.norm(c.hidden_size)
        self.engram = Engram(f, layer) if layer in c.engram_layer_ids else None
        self.attn = Attention(f, layer)
        self.ffn = MoE(f, layer)

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        batch: ForwardBatch,
        cache: DeepseekV41Cache,
        state: ForwardState,
        engram_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [T, n, D], pre [T, n] float32) -> the same for the next layer."""
        ops, c = self.ops, self.config
        hc = (c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        if self.engram is not None:
            streams = self.engram(streams, engram_rows, state.image_rows)
        pre_attn, post, comb = ops.hc_mix(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *hc)
        attn_out = self.attn(self.attn_norm(ops.hc_collapse(streams, pre)), batch, cache, state)
        streams = ops.hc_expand(attn_out, streams, post, comb)
        pre_ffn, post, comb = ops.hc_mix(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *hc)
        ffn_in = self.ffn_norm(ops.hc_collapse(streams, pre_attn))
        ffn_out = self.ffn(ffn_in) if state.image_rows is None else self.ffn(ffn_in, image_rows=state.image_rows)
        streams = ops.hc_expand(ffn_out, streams, post, comb)
        self.trace.record(f"hidden_streams.layer{self.layer}", streams)
        self.trace.record(f"pre_mix.layer{self.layer}", pre_ffn)
        return streams, pre_ffn
