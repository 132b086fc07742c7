"""The MTP drafter: DeepSeek-V4's next-n layer proposes tokens, reapplied to its own output streams.

After a target step the MTP layer runs over the step's accepted rows (row at position p: the
target's streams at p and the token at p+1), which extends its own sliding-window cache exactly as
far as the target's. Each sequence's last row gives draft 1. Draft j+1 comes from one more MTP row at
the next position whose H is the MTP's own output streams of draft j's row (MODEL_SPEC §6). Those
chained rows are guesses, so their window rows are put back afterwards: the MTP cache always ends
where the target's ends, and the next target step's accepted rows overwrite the chained positions.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache, DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v4.rollback import RingSnapshot, ring_tensors
from deepinfer_core.models.forward_batch import ForwardBatch

from .config import SpeculativeConfig
from .drafter import Draft, DraftContext, Drafter, confident_prefix
from .sampling import draw, select_rows

__all__ = ["MtpDrafter", "MtpUnavailable"]


class MtpUnavailable(ValueError):
    """The checkpoint has no MTP layer, or its caches are too short for the requested drafts."""


class MtpDrafter(Drafter):
    def __init__(
        self, model: DeepseekV4ForCausalLM, cache: DeepseekV4Cache, config: SpeculativeConfig, mtp_layer: int = 0
    ) -> None:
        if mtp_layer >= len(model.mtp):
            raise MtpUnavailable(
                f"MTP layer {mtp_layer} requested but the checkpoint has {len(model.mtp)} "
                "(num_nextn_predict_layers); turn speculative decoding off for this model"
            )
        self.model, self.cache, self.config, self.mtp_layer = model, cache, config, mtp_layer
        self.rings = ring_tensors([cache.layers[model.config.num_hidden_layers + mtp_layer]])
        shortest = min(ring.shape[1] for ring in ring_tensors(cache.layers))
        if config.num_draft_tokens + 1 > shortest:
            raise MtpUnavailable(
                f"num_draft_tokens {config.num_draft_tokens} needs verification steps of "
                f"{config.num_draft_tokens + 1} tokens, but the shortest cache ring holds {shortest}: "
                f"use num_draft_tokens <= {shortest - 1}"
            )

    def propose(self, context: DraftContext, sampling: SamplingTensors, max_drafts: list[int]) -> Draft:
        model, batch = self.model, context.batch
        num_seqs, device = batch.num_seqs, context.streams.device
        k = min(self.config.num_draft_tokens, max(max_drafts, default=0))
        out = model.mtp_forward(context.streams, context.next_token_ids, batch, self.cache, self.mtp_layer)
        last = (batch.query_start_loc[1:].to(device, torch.long) - 1)
        logits, streams = out.logits[last], out.streams[last]
        next_positions = batch.positions[last] + 1
        tokens = torch.full((num_seqs, k), -1, dtype=torch.long, device=device)
        confidences = torch.zeros((num_seqs, k), dtype=torch.float32, device=device)
        probs = None if sampling.all_greedy else torch.zeros((num_seqs, k, logits.shape[-1]), device=device)
        limit = torch.tensor(max_drafts, dtype=torch.long, device=device).clamp(max=k)
        active = list(range(num_seqs))
        chain = self._snapshot_chain(batch, next_positions, k)
        for j in range(k):
            rows = torch.tensor(active, dtype=torch.long, device=device)
            drawn, confidence, q = draw(logits, select_rows(sampling, rows, j))
            keep = (confidence >= self.config.confidence_threshold) & (limit[rows] > j)
            tokens[rows, j] = torch.where(keep, drawn, -1)
            confidences[rows, j] = confidence
            if probs is not None:
                probs[rows, j] = q
            keep_cpu = keep.tolist()
            active = [seq for seq, kept in zip(active, keep_cpu) if kept]
            if not active or j + 1 == k:
                break
            survivors = torch.tensor([i for i, kept in enumerate(keep_cpu) if kept], dtype=torch.long, device=device)
            step = _chain_batch(batch, active, next_positions + j, device)
            out = model.mtp_forward(streams[survivors], drawn[survivors], step, self.cache, self.mtp_layer)
            logits, streams = out.logits, out.streams
        if chain is not None:
            chain.restore(torch.zeros(num_seqs, dtype=torch.long))
        return Draft(tokens, confidences, confident_prefix(confidences, limit, self.config.confidence_threshold), probs)

    def _snapshot_chain(self, batch: ForwardBatch, next_positions: torch.Tensor, k: int) -> RingSnapshot | None:
        if k < 2:
            return None
        return RingSnapshot.take(self.rings, batch.slot_ids_cpu, next_positions.tolist(), [k - 1] * batch.num_seqs)


def _chain_batch(batch: ForwardBatch, seqs: list[int], positions: torch.Tensor, device: torch.device) -> ForwardBatch:
    """One MTP row per sequence in `seqs`, at positions[seq], with everything before it cached."""
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    pos = positions[index]
    pos_cpu = pos.tolist()
    return ForwardBatch(
        input_ids=torch.zeros(len(seqs), dtype=torch.long, device=device),
        positions=pos,
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
        context_lens=pos.to(torch.int32),
        slot_ids=batch.slot_ids[index.to(batch.slot_ids.device)],
        block_tables=batch.block_tables[index.to(batch.block_tables.device)],
        logits_indices=torch.arange(len(seqs), device=device),
        query_lens_cpu=[1] * len(seqs),
        context_lens_cpu=pos_cpu,
        slot_ids_cpu=[batch.slot_ids_cpu[i] for i in seqs],
        block_tables_cpu=[batch.block_tables_cpu[i] for i in seqs],
    )
