"""The KV source's compressor (MODEL_SPEC_V41 §4.1): one pre-RoPE latent per group of `ratio` tokens."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.linear import LinearGroup
from deepinfer_core.models.forward_batch import ForwardBatch

from .cache import BandCache
from .factory import ModuleFactory

__all__ = ["Compressor", "NewGroups"]


class NewGroups:
    """Latents [G, head_dim] of the groups completed by a step, their entry ids and sequences."""

    __slots__ = ("latents", "entry_ids", "seq_index")

    def __init__(self, latents: torch.Tensor, entry_ids: torch.Tensor, seq_index: torch.Tensor) -> None:
        self.latents, self.entry_ids, self.seq_index = latents, entry_ids, seq_index


class Compressor(nn.Module):
    """ratio 1: latent = RMSNorm(x Wkv) per token, model dtype. ratio r > 1: projections in float32,
    per-channel softmax(gate) pooling over each group's r tokens, cast, RMSNorm. A group's tokens may
    span steps: the open group's raw projections wait in the band cache.

    A plain decode step (`ForwardBatch.is_plain_decode`) pools every sequence's open group, complete or
    not, with nothing planned on the host: a group still open yields a provisional entry at its own id,
    which no query sees before the step that completes the group overwrites it (entry w is visible from
    position (w + 1) * r - 1 on, the group's last token)."""

    def __init__(self, f: ModuleFactory, ratio: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.ratio, self.dtype = f.ops, ratio, f.dtype
        self.wkv = f.linear(c.hidden_size, c.head_dim, quantizable=False)
        self.wgate = f.linear(c.hidden_size, c.head_dim, quantizable=False) if ratio > 1 else None
        self.norm = f.norm(c.head_dim)
        # (kv, gate) of a float32 x in one launch (ratio > 1)
        self.projections = LinearGroup(self.wkv, self.wgate) if self.wgate is not None else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, band: BandCache) -> NewGroups:
        device = x.device
        seq_index = batch.row_sequences()
        if self.wgate is None:
            return NewGroups(self.norm(self.wkv(x)), batch.positions.to(torch.long), seq_index)
        kv, gate = self.projections(x.float())
        if batch.is_plain_decode:
            return self._decode(kv, gate, batch, band)
        r, pooled_kv, pooled_gate, entry_ids, seqs = self.ratio, [], [], [], []
        start = 0
        for i, (slot, n_q, ctx) in enumerate(zip(batch.slot_ids_cpu, batch.query_lens_cpu, batch.context_lens_cpu)):
            n_open = ctx % r
            seq_kv = torch.cat([band.open_kv[slot, :n_open], kv[start:start + n_q]])
            seq_gate = torch.cat([band.open_gate[slot, :n_open], gate[start:start + n_q]])
            groups = seq_kv.shape[0] // r
            pooled_kv.append(seq_kv[: groups * r].view(groups, r, kv.shape[-1]))
            pooled_gate.append(seq_gate[: groups * r].view(groups, r, kv.shape[-1]))
            entry_ids.append(torch.arange(ctx // r, ctx // r + groups, device=device))
            seqs.append(torch.full((groups,), i, device=device, dtype=torch.long))
            rest = seq_kv.shape[0] - groups * r
            band.open_kv[slot, :rest] = seq_kv[groups * r:]
            band.open_gate[slot, :rest] = seq_gate[groups * r:]
            start += n_q
        latents = self.ops.gated_pool(torch.cat(pooled_kv), torch.cat(pooled_gate)).to(self.dtype)
        return NewGroups(self.norm(latents), torch.cat(entry_ids), torch.cat(seqs))

    def _decode(self, kv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch, band: BandCache) -> NewGroups:
        """One token a sequence: it takes row ctx % r of its slot's open group, whose r rows are pooled
        (rows of the previous group where this one is not full yet: the provisional entry is never read)."""
        slots, ctx = batch.slot_ids.to(torch.long), batch.context_lens.to(torch.long)
        band.open_kv[slots, ctx % self.ratio] = kv
        band.open_gate[slots, ctx % self.ratio] = gate
        latents = self.ops.gated_pool(band.open_kv[slots], band.open_gate[slots]).to(self.dtype)
        seq_index = torch.arange(batch.num_seqs, device=kv.device)
        return NewGroups(self.norm(latents), ctx // self.ratio, seq_index)
