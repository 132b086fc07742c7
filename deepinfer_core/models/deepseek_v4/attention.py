"""Shared-KV attention of one block: sliding window, plus compressed entries on CSA / HCA layers."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.model_config import CSA, LayerSpec
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, QuantizedActivations

from .cache import LayerCache
from .compressor import Compressor
from .factory import ModuleFactory
from .indexer import Indexer
from .linear import LinearGroup
from .rope import rope_inv_freq
from .step_rows import StepRows

__all__ = ["Attention", "output_for", "output_projection"]


class Attention(nn.Module):
    def __init__(self, f: ModuleFactory, spec: LayerSpec) -> None:
        super().__init__()
        c = f.config
        self.ops, self.eps, self.ratio = f.ops, c.rms_norm_eps, spec.compress_ratio
        self.n_heads, self.head_dim, self.o_groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.wq_a = f.linear(c.hidden_size, c.q_lora_rank, quantizable=True)
        self.q_norm = f.norm(c.q_lora_rank)
        self.wq_b = f.linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, quantizable=True)
        self.wkv = f.linear(c.hidden_size, c.head_dim, quantizable=True)
        self.kv_norm = f.norm(c.head_dim)
        group_width = c.num_attention_heads * c.head_dim // c.o_groups
        self.wo_a = f.linear(group_width, c.o_groups * c.o_lora_rank, quantizable=True)
        self.wo_b = f.linear(c.o_groups * c.o_lora_rank, c.hidden_size, quantizable=True)
        self.attn_sink = f.param(c.num_attention_heads, dtype=torch.float32)
        self.compressor = None
        if spec.is_compressed:
            self.compressor = Compressor(f, spec.compress_ratio, c.head_dim, overlap=spec.attention == CSA)
        self.indexer = Indexer(f, spec.compress_ratio) if spec.attention == CSA else None
        # The cache's compressor then indexer states, in this order (LayerCache).
        pools = (self.compressor, self.indexer.compressor if self.indexer is not None else None)
        self.pools = [m for m in pools if m is not None]
        # every projection of x (the indexer's head weights last): one launch per weight format
        head_weights = [self.indexer.weights_proj] if self.indexer is not None else []
        self.projections = LinearGroup(
            self.wq_a, self.wkv, *(w for pool in self.pools for w in (pool.wkv, pool.wgate)), *head_weights
        )
        self.step_rows = StepRows()
        rope = c.rope_compress if spec.is_compressed else c.rope_main
        self.register_buffer("inv_freq", rope_inv_freq(rope, c.qk_rope_head_dim).to(f.device), persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        ops, pos = self.ops, batch.positions
        q_lora, kv_latent, *projections = self.projections(x)
        head_weights = projections.pop() if self.indexer is not None else None
        q_latent, kv = ops.latent_norms(
            q_lora, self.q_norm.weight, kv_latent, self.kv_norm.weight, self.q_norm.eps, pos, self.inv_freq
        )
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)  # normalised and rotated by the attention
        # Every row of the step reaches the cache; this process's queries (`batch`) read it.
        keys, step = self.step_rows.share_keys([kv, *projections], batch, cache.window)
        step_kv, projections = keys[0], keys[1:]
        states = [s for s in (cache.compressor, cache.indexer) if s is not None]
        for pool, state, pool_kv, pool_gate in zip(self.pools, states, projections[0::2], projections[1::2]):
            pool(pool_kv, pool_gate, self.inv_freq, step, state)
        entries = cache.compressor.entries if self.compressor is not None else None
        selected = None
        if self.indexer is not None:
            selected = self.indexer(head_weights, q_latent, self.inv_freq, batch, cache.indexer)
        out = output_for(self.wo_a, ops, q, kv, cache.window, self.attn_sink, self.head_dim**-0.5, batch,
                         self.inv_freq, q_norm_eps=self.eps, entries=entries, ratio=self.ratio, selected=selected)
        ops.store_window(step_kv, cache.window, step)
        return output_projection(ops, out, q.shape[0], self.o_groups, self.wo_a, self.wo_b)


def output_for(
    wo_a: nn.Module, ops: KernelOps, *args: object, **kwargs: object
) -> torch.Tensor | QuantizedActivations:
    """`ops.rotary_attention(*args, **kwargs)` (its seven leading arguments positional), or its fp8 codes from the
    attention itself where the output projection wo_a takes them (`KernelOps.quantized_input_group`: W8A8 on a
    backend that quantises in the attention's epilogue; the output then goes to memory once, in fp8)."""
    group = ops.quantized_input_group(wo_a.weight, wo_a.block)
    if group is None:
        return ops.rotary_attention(*args, **kwargs)
    return ops.rotary_attention_quantized(*args, group=group, **kwargs)


def output_projection(
    ops: KernelOps, out: torch.Tensor | QuantizedActivations, tokens: int, o_groups: int, wo_a: nn.Module,
    wo_b: nn.Module,
) -> torch.Tensor:
    """wo_b of wo_a of the attention's output (its values or codes, `output_for`), wo_a a block-diagonal projection
    of each token's `o_groups` groups of heads. wo_a hands wo_b its output as fp8 codes where wo_b takes them
    (`KernelOps.grouped_linear_quantized`, `quantized_input_group`: W8A8 on a backend that quantises in the
    product's epilogue)."""
    grouped = out.view(tokens, o_groups, -1)
    group = ops.quantized_input_group(wo_b.weight, wo_b.block)
    if group is None:
        return wo_b(ops.grouped_linear(grouped, wo_a.weight, wo_a.scale, wo_a.block).flatten(1))
    return wo_b(ops.grouped_linear_quantized(grouped, wo_a.weight, wo_a.scale, wo_a.block, group))
