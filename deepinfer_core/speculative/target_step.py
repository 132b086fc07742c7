"""The target model's side of speculative decoding: verify drafts in one step, roll back the rest.

`verify_step` runs one multi-token step over [last token, drafts] per sequence, verifies the drafts
against its logits, rolls the target's rings back to the accepted positions (rollback.py) and hands
the drafter the accepted rows. `prefill_context` does the last part for a plain (prefill) step.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache, DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v4.rollback import RingSnapshot, ring_tensors
from deepinfer_core.models.forward_batch import ForwardBatch

from .drafter import Draft, DraftContext
from .verifier import Verification, verify

__all__ = ["prefill_context", "verify_step"]


def verify_step(
    model: DeepseekV4ForCausalLM,
    cache: DeepseekV4Cache,
    batch: ForwardBatch,
    draft: Draft,
    sampling: SamplingTensors,
) -> tuple[Verification, DraftContext]:
    """`batch`: sequence i's rows are its last emitted token then its draft.lengths[i] drafts, at
    positions context_lens[i] ... `sampling`: one row per sequence, positions = output index of the
    token after the last emitted one. Afterwards the cache holds exactly the accepted positions."""
    main_rings = ring_tensors(cache.layers[: model.config.num_hidden_layers])
    snapshot = RingSnapshot.take(main_rings, batch.slot_ids_cpu, batch.context_lens_cpu, batch.query_lens_cpu)
    out = model(batch, cache)
    verification = verify(model.compute_logits(out.hidden), draft, sampling, model.ops.sample)
    snapshot.restore(verification.num_emitted)
    return verification, _accepted_context(batch, out.streams, verification)


def prefill_context(batch: ForwardBatch, streams: torch.Tensor, next_tokens: torch.Tensor) -> DraftContext:
    """The drafter's input after a plain step: every row, each followed by the next row's token and
    each sequence's last row by next_tokens[i] (the sampled token, or the next chunk's first)."""
    device = streams.device
    following = torch.roll(batch.input_ids, -1)
    last = batch.query_start_loc[1:].to(device, torch.long) - 1
    following[last] = next_tokens.to(following.dtype)
    return DraftContext(batch, streams, following)


def _accepted_context(batch: ForwardBatch, streams: torch.Tensor, verification: Verification) -> DraftContext:
    device = streams.device
    kept = verification.num_emitted
    kept_cpu = kept.tolist()
    seqs = torch.arange(len(kept_cpu), device=device)
    index = torch.repeat_interleave(seqs, kept)
    offsets = torch.arange(len(index), device=device) - (kept.cumsum(0) - kept)[index]
    rows = batch.query_start_loc[:-1].to(device, torch.long)[index] + offsets
    width = verification.tokens.shape[1]
    accepted = ForwardBatch(
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        query_start_loc=torch.nn.functional.pad(kept.cumsum(0), (1, 0)).to(batch.query_start_loc.dtype),
        context_lens=batch.context_lens,
        slot_ids=batch.slot_ids,
        block_tables=batch.block_tables,
        logits_indices=torch.arange(len(index), device=device),
        query_lens_cpu=kept_cpu,
        context_lens_cpu=batch.context_lens_cpu,
        slot_ids_cpu=batch.slot_ids_cpu,
        block_tables_cpu=batch.block_tables_cpu,
    )
    next_tokens = verification.tokens.flatten()[index * width + offsets]
    return DraftContext(accepted, streams[rows], next_tokens)
