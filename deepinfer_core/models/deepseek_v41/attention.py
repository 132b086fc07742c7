"""V4.1 attention of one layer (MODEL_SPEC_V41 §4): sliding window plus the band's shared compressed KV.

Roles: a KV source compresses its tokens and publishes the band's entries and indexer keys; an index
source (the KV source itself, or a Reindex layer) selects entries per token; every other layer with
ratio > 0 (Reuse) attends the latest selection. No per-head q norm.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.attention import output_for, output_projection
from deepinfer_core.models.deepseek_v4.linear import LinearGroup
from deepinfer_core.models.deepseek_v4.rope import rope_inv_freq
from deepinfer_core.models.forward_batch import ForwardBatch, NotOnHost

from .band import BandState, picked_entries, write_entries
from .cache import DeepseekV41Cache
from .compressor import Compressor, NewGroups
from .factory import ModuleFactory
from .indexer import Indexer
from .kv_quant import StoredTensor

__all__ = ["Attention", "ForwardState", "store_in_ring"]


# No op reads the renumbered step's host block tables: they are never built (the picked entries' tables exist
# on the device only, and a full copy of the renumbered ones would be host work on every step).
_LOCAL_TABLES = "of a V4.1 step renumbered onto its decoded copies (ForwardState.local): read block_tables"


class ForwardState:
    """Per-forward state carried from layer to layer: the open band, the step's batch renumbered
    onto the decoded copies of its slots (0..S-1) and blocks (row-major over its block tables), the
    rows that are image-span tokens (int64 on the device, or None), and where the step's slots lie in
    the window rings (every layer's ring has one shape, so the first layer's addressing serves all)."""

    __slots__ = ("band", "local", "image_rows", "ring_rows", "ring_writes")

    def __init__(self, batch: ForwardBatch) -> None:
        self.band: BandState | None = None
        self.image_rows: torch.Tensor | None = None
        self.ring_rows: torch.Tensor | None = None  # the slots' ring vectors, flat ids [S, W]
        self.ring_writes: torch.Tensor | None = None  # a plain decode step's flat ids of each token's K=V
        n_seqs, width = batch.block_tables.shape
        tables = torch.arange(n_seqs * width, dtype=torch.int32, device=batch.block_tables.device).view(n_seqs, width)
        self.local = replace(
            batch, slot_ids=torch.arange(n_seqs, dtype=torch.int32, device=batch.slot_ids.device),
            slot_ids_cpu=list(range(n_seqs)), block_tables=tables,
            block_tables_cpu=NotOnHost(n_seqs, "block_tables_cpu", _LOCAL_TABLES),
        )


class Attention(nn.Module):
    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.kv, self.layer = f.ops, f.kv, layer
        self.ratio = c.compress_ratios[layer]
        self.n_heads, self.head_dim, self.o_groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.wq_a = f.linear(c.hidden_size, c.q_lora_rank, quantizable=True)
        self.q_norm = f.norm(c.q_lora_rank)
        self.wq_b = f.linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, quantizable=True)
        self.wkv = f.linear(c.hidden_size, c.head_dim, quantizable=True)
        self.kv_norm = f.norm(c.head_dim)
        self.latents = LinearGroup(self.wq_a, self.wkv)  # both of x, one launch
        group_width = c.num_attention_heads * c.head_dim // c.o_groups
        self.wo_a = f.linear(group_width, c.o_groups * c.o_lora_rank, quantizable=True)
        self.wo_b = f.linear(c.o_groups * c.o_lora_rank, c.hidden_size, quantizable=True)
        self.attn_sink = f.param(c.num_attention_heads, dtype=torch.float32)
        is_source = layer in c.kv_source_layer_ids
        self.compressor = Compressor(f, self.ratio) if is_source else None
        self.indexer = Indexer(f, layer) if layer in c.index_source_layer_ids else None
        rope = c.rope_compress if self.ratio else c.rope_main
        self.register_buffer("inv_freq", rope_inv_freq(rope, c.qk_rope_head_dim).to(f.device), persistent=False)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: DeepseekV41Cache, state: ForwardState
    ) -> torch.Tensor:
        ops, pos = self.ops, batch.positions
        q_lora, kv_latent = self.latents(x)
        q_latent, kv = ops.latent_norms(
            q_lora, self.q_norm.weight, kv_latent, self.kv_norm.weight, self.q_norm.eps, pos, self.inv_freq
        )
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)  # rotated by the attention
        kv = self.kv.window(kv)
        if self.compressor is not None:
            state.band = BandState(self.layer, cache.bands[self.layer])
            self._publish(x, batch, state.band)
        if self.indexer is not None:
            state.band.selected = self.indexer(x, q_latent, self.inv_freq, batch, state.band)
        band = state.band if self.ratio else None
        attend = band is not None and band.selected is not None
        window = cache.windows[self.layer]
        if state.ring_rows is None:
            slots = batch.slot_ids.to(torch.long)
            state.ring_rows = window.rows((slots,))
            if batch.is_plain_decode:
                state.ring_writes = decode_ring_writes(batch, window, slots)
        # NOTE: the reference ops read plain tensors, so the step's slots and blocks are decoded first (in a
        # plain decode step, only the selected entries); a fused kernel reads the fp8/fp4 codes directly.
        ring = window.read_rows(ops, state.ring_rows)
        entries, local = None, state.local
        if attend and batch.is_plain_decode:
            entries, tables = picked_entries(ops, band, batch)
            local = replace(local, block_tables=tables)
        elif attend:
            entries = band.cache.entries.read(ops, (batch.block_tables.clamp(min=0).to(torch.long),)).flatten(0, 1)
        out = output_for(
            self.wo_a, ops, q, kv, ring, self.attn_sink, self.head_dim**-0.5, local, self.inv_freq,
            entries=entries, ratio=self.ratio, selected=band.selected if attend else None,
        )
        store_in_ring(self.ops, kv, batch, window, state.ring_writes)
        return output_projection(ops, out, q.shape[0], self.o_groups, self.wo_a, self.wo_b)

    def _publish(self, x: torch.Tensor, batch: ForwardBatch, band: BandState) -> None:
        """Compress the step's tokens; store the completed groups' entries and indexer keys."""
        new = self.compressor(x, batch, band.cache)
        if batch.reused_lens_cpu is not None:  # bounded prefix replay: cached entries stay as they are
            keep = new.entry_ids * self.ratio >= torch.tensor(batch.reused_lens_cpu, device=x.device)[new.seq_index]
            new = NewGroups(new.latents[keep], new.entry_ids[keep], new.seq_index[keep])
        if new.entry_ids.numel() == 0:
            return
        positions = new.entry_ids * self.ratio
        entries = self.kv.entry(self.ops.rope(new.latents, positions, self.inv_freq))
        keys = self.indexer.keys(new.latents, positions, self.inv_freq)
        write_entries(self.ops, batch, new.seq_index, new.entry_ids, (band.cache.entries, entries),
                      (band.cache.index_keys, keys))


def store_in_ring(
    ops, kv: torch.Tensor, batch: ForwardBatch, window: StoredTensor, decode_writes: torch.Tensor | None = None,
) -> None:
    """Each sequence's last min(q, W) positions p of the step go to ring row p % W of its slot.
    `decode_writes`: a plain decode step's `decode_ring_writes`, if already built."""
    if batch.is_plain_decode:
        if decode_writes is None:
            decode_writes = decode_ring_writes(batch, window, batch.slot_ids.to(torch.long))
        window.write_rows(ops, decode_writes, kv)
        return
    ring = window.parts[0].shape[1]
    slots, rows, offsets = [], [], []
    start = 0
    for slot, n_q, ctx in zip(batch.slot_ids_cpu, batch.query_lens_cpu, batch.context_lens_cpu):
        keep = torch.arange(max(ctx, ctx + n_q - ring), ctx + n_q, device=kv.device)
        slots.append(torch.full_like(keep, slot))
        offsets.append(keep % ring)
        rows.append(start + keep - ctx)
        start += n_q
    if start:
        window.write(ops, (torch.cat(slots), torch.cat(offsets)), kv[torch.cat(rows)])


def decode_ring_writes(batch: ForwardBatch, window: StoredTensor, slots: torch.Tensor) -> torch.Tensor:
    """A plain decode step's flat vector ids (`StoredTensor.rows`) of each token's K=V: one position a sequence,
    its context length, at ring row (slot, context length mod ring)."""
    return window.rows((slots, batch.context_lens.to(torch.long) % window.parts[0].shape[1]))
