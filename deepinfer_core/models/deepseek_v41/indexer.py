"""The lightning indexer of an index-source layer, with the two-level candidate top-k (MODEL_SPEC_V41 §4.2)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.forward_batch import ForwardBatch

from .band import DECODE_ROWS, BandState, gather_entries
from .factory import ModuleFactory

__all__ = ["DECODE_SCORE_ELEMENTS", "Indexer", "candidate_mask"]

# A decode step scores all its sequences at once while their keys and per-head products stay under this many
# values (64 sequences at a bound of 8,192 entries: one pass, 84M); longer contexts at larger batches go a few
# sequences at a time, so that the transient stays near 1.5 GB instead of growing with the batch (256
# sequences of 65,536 entries at once: over 15 GB of keys, their float32 copy and the products).
DECODE_SCORE_ELEMENTS = 1 << 28


def candidate_mask(scores: torch.Tensor, visible_counts: torch.Tensor, top_blocks: int, block_size: int) -> torch.Tensor:
    """[q, n] bool: entries inside each query's top `top_blocks` blocks of `block_size` entries.

    A block scores the max of its entries (-inf = none visible); the block holding the query's newest
    visible entry is always kept; blocks scoring -inf are never kept.
    """
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -n % block_size), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block_size)).amax(-1)
    newest = torch.arange(blocks.shape[-1], device=scores.device) == (
        (visible_counts - 1).div(block_size, rounding_mode="floor")).unsqueeze(-1)
    if blocks.shape[-1] <= top_blocks:
        # every block is in the top: the same mask without ranking them (a decode step below
        # top_blocks * block_size entries: the top-k's sort took ~28 us of an H200's batch-1 step)
        keep = (blocks > float("-inf")) | newest
    else:
        top = blocks.masked_fill(newest, float("inf")).topk(top_blocks, dim=-1)
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.unsqueeze(-1).expand(*keep.shape, block_size).flatten(-2)[..., :n]


class Indexer(nn.Module):
    """`wq_b`, `weights_proj`; on a KV source also `wk`, `k_norm` (keys from the pre-RoPE latent)."""

    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.kv, self.trace, self.layer = f.ops, f.kv, f.trace, layer
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.ratio = c.compress_ratios[layer]
        self.is_candidate_source = layer == c.candidate_source_layer_id
        self.uses_candidates = c.uses_candidates(layer)
        self.candidate_blocks, self.candidate_block_size = c.candidate_topk_blocks, c.candidate_block_size
        self.wq_b = f.linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, quantizable=True)
        self.weights_proj = f.linear(c.hidden_size, c.index_n_heads, quantizable=False)
        if layer in c.kv_source_layer_ids:
            self.wk = f.linear(c.head_dim, c.index_head_dim, quantizable=False)
            self.k_norm = f.norm(c.index_head_dim)

    def keys(self, latents: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Indexer keys of new groups: FP4(RoPE(RMSNorm(latent Wk), group position))."""
        return self.kv.index(self.ops.rope(self.k_norm(self.wk(latents)), positions, inv_freq))

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, inv_freq: torch.Tensor, batch: ForwardBatch, band: BandState
    ) -> torch.Tensor:
        """[T, index_topk] int64 selected entry ids per token (-1 = empty), any order."""
        ops, r = self.ops, self.ratio
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        q = self.kv.index(ops.rope(q, batch.positions, inv_freq))
        head_weights = self.weights_proj(x)
        visible = (batch.positions + 1).div(r, rounding_mode="floor")  # each query's visible entries
        if batch.is_plain_decode:
            return self._decode(q, head_weights, visible, batch, band)
        selected = torch.full((x.shape[0], self.topk), -1, dtype=torch.long, device=x.device)
        start = 0
        for i, (n_q, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            rows, start = slice(start, start + n_q), start + n_q
            n_entries = (ctx + n_q) // r
            if n_entries == 0:
                continue
            keys = gather_entries(ops, band.cache.index_keys, batch.block_tables[i], n_entries)
            scores = ops.indexer_scores(q[rows], keys, head_weights[rows], visible[rows])
            picks = self._picks(scores, visible[rows], band, i, f"candidates.layer{self.layer}.seq{i}",
                                ops.batch_invariant)
            selected[rows, : picks.shape[1]] = picks
        self.trace.record(f"index_topk.layer{self.layer}", selected)
        return selected

    def _decode(
        self, q: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor, batch: ForwardBatch, band: BandState
    ) -> torch.Tensor:
        """One query a sequence, all sequences at once over the bound's entries (`seq_len_bound`): each
        query scores its own sequence's keys, entries it cannot see score -inf. The top-k is always the
        stable one, so that a row's picks do not depend on how far past its entries the bound reaches."""
        n_entries = batch.seq_len_bound // self.ratio
        if n_entries == 0:
            return torch.full((q.shape[0], self.topk), -1, dtype=torch.long, device=q.device)
        tables, rows = batch.block_tables, q.shape[0]  # unallocated (-1) blocks: `paged_rows` reads block 0
        chunk = max(1, DECODE_SCORE_ELEMENTS // (n_entries * (self.head_dim + self.n_heads)))
        if chunk >= rows:
            if band.index_keys is None:  # decoded once a step for the band's index sources
                band.index_keys = gather_entries(self.ops, band.cache.index_keys, tables, n_entries)
            scores = self.ops.indexer_scores(q, band.index_keys, head_weights, visible)
        else:  # each index source decodes its keys again, a chunk at a time
            scores = torch.cat([
                self.ops.indexer_scores(q[s:s + chunk], gather_entries(self.ops, band.cache.index_keys,
                                                                       tables[s:s + chunk], n_entries),
                                        head_weights[s:s + chunk], visible[s:s + chunk])
                for s in range(0, rows, chunk)
            ])
        selected = self._picks(scores, visible, band, DECODE_ROWS, f"candidates.layer{self.layer}", stable=True)
        if selected.shape[1] < self.topk:  # fewer entries than picks under the bound: -1 the rest
            selected = torch.nn.functional.pad(selected, (0, self.topk - selected.shape[1]), value=-1)
        self.trace.record(f"index_topk.layer{self.layer}", selected)
        return selected

    def _picks(
        self, scores: torch.Tensor, visible_counts: torch.Tensor, band: BandState, key: int, trace_name: str,
        stable: bool,
    ) -> torch.Tensor:
        """Entry ids [q, min(topk, n)] (-1 = none) from scores [q, n] (-inf past each query's `visible_counts`,
        as `indexer_scores` masks them): the candidate source's mask published under `key` (it picks outside
        it too) or, on an index source after it, applied."""
        n_entries = scores.shape[-1]
        if self.is_candidate_source:
            band.candidates[key] = candidate_mask(scores, visible_counts, self.candidate_blocks, self.candidate_block_size)
            self.trace.record(trace_name, band.candidates[key])
        elif self.uses_candidates and key in band.candidates:
            scores = scores.masked_fill(~band.candidates[key], float("-inf"))
        k = min(self.topk, n_entries)
        if stable:  # ties to the lowest entry index instead of topk's unspecified order
            return self.ops.top_entries(scores, k)
        top = scores.topk(k, dim=-1)
        return torch.where(top.values > float("-inf"), top.indices, -1)
