"""The engine's side of speculative decoding: one step verifies every sequence's drafts and drafts anew.

A sampling sequence with n drafts owns 1 + n consecutive logits rows (its last token, then the
drafts); one without drafts owns one row, so `verify` handles both (no drafts = a plain draw).
After verification the main model's rings are rolled back to the accepted positions, and the
drafter sees one `DraftContext` over the step's kept rows: every row of a prefill chunk, the last
token and the accepted drafts of a verifying sequence. Each kept row is followed by the token at
the next position: the next row's input, and after a sequence's last kept row the token the step
emitted (or, for a prefill chunk that is not the prompt's last, the next chunk's first token).

NOTE: the engine reads each speculative step's results before it schedules the next one (drafts
decide the next step's shape), so with speculation the host does not overlap the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.engine.scheduler import ScheduledSeq
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.speculative import Draft, DraftContext

__all__ = ["SpeculativePlan", "kept_context", "plan_step", "propose_sampling", "step_draft"]


@dataclass(slots=True)
class SpeculativePlan:
    """Host-side shape of one speculative step, built with its inputs."""

    draft_lengths: list[int]     # per sampling sequence: drafts verified this step
    first_rows: list[int]        # per sampling sequence: its first logits row
    row_seqs: torch.Tensor       # [sample rows] int64: the sampling sequence of each logits row
    row_offsets: torch.Tensor    # [sample rows] int64: the row's index inside its sequence's rows
    sampling_index: list[int]    # per scheduled item: its sampling sequence, or -1 (a non-final chunk)
    next_prompt_token: list[int]  # per scheduled item: the next chunk's first token (non-final chunks)
    tokens_before: list[int]     # per scheduled item: tokens known before the step's emitted ones
    draft: Draft                 # one row per sampling sequence, on the device


def plan_step(
    scheduled: list[ScheduledSeq], sampling_seqs: list[Sequence], vocab_size: int, device: torch.device
) -> SpeculativePlan:
    index_of = {id(seq): i for i, seq in enumerate(sampling_seqs)}
    drafts = {id(item.seq): item.draft for item in scheduled if item.samples}
    lengths = [len(drafts.get(id(seq), [])) for seq in sampling_seqs]
    first_rows, row_seqs, row_offsets = [], [], []
    for i, n in enumerate(lengths):
        first_rows.append(len(row_seqs))
        row_seqs += [i] * (n + 1)
        row_offsets += range(n + 1)
    sampling_index, next_prompt_token, tokens_before = [], [], []
    for item in scheduled:
        sampling_index.append(index_of.get(id(item.seq), -1) if item.samples else -1)
        end = item.start + item.num_tokens
        next_prompt_token.append(item.seq.token_ids[end] if not item.samples else 0)
        tokens_before.append(item.seq.num_tokens - 1 if item.samples else item.seq.num_tokens)
    return SpeculativePlan(
        draft_lengths=lengths,
        first_rows=first_rows,
        row_seqs=torch.tensor(row_seqs, dtype=torch.long, device=device),
        row_offsets=torch.tensor(row_offsets, dtype=torch.long, device=device),
        sampling_index=sampling_index,
        next_prompt_token=next_prompt_token,
        tokens_before=tokens_before,
        draft=step_draft([drafts.get(id(seq), []) for seq in sampling_seqs], sampling_seqs, vocab_size, device),
    )


def step_draft(drafts: list[list[int]], seqs: list[Sequence], vocab_size: int, device: torch.device) -> Draft:
    """The Draft `verify` reads: row i holds drafts[i] (a prefix of seqs[i]'s drafts, the budget may
    have cut it) and the distributions they were drawn from. A sampled sequence whose drafter gave
    no distribution drafted a point mass."""
    width = max((len(d) for d in drafts), default=0)
    tokens = torch.full((len(drafts), width), -1, dtype=torch.long)
    for i, draft in enumerate(drafts):
        tokens[i, :len(draft)] = torch.tensor(draft, dtype=torch.long)
    tokens = tokens.to(device)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    probs = None
    if width and any(not seq.params.greedy for seq in seqs):
        probs = torch.zeros((len(drafts), width, vocab_size), dtype=torch.float32, device=device)
        for i, (draft, seq) in enumerate(zip(drafts, seqs)):
            if not draft:
                continue
            if seq.draft_probs is not None:
                probs[i, :len(draft)] = seq.draft_probs[:len(draft)]
            else:
                probs[i, torch.arange(len(draft), device=device), tokens[i, :len(draft)]] = 1.0
    return Draft(tokens, torch.ones((len(drafts), width), device=device), lengths, probs)


def kept_context(
    batch: ForwardBatch, streams: torch.Tensor, kept: list[int], last_next_tokens: torch.Tensor
) -> DraftContext:
    """The drafter's input: the first kept[i] rows of scheduled item i, each followed by the next
    row's input token, and item i's last kept row by last_next_tokens[i]."""
    device = streams.device
    starts = [0] + torch.tensor(batch.query_lens_cpu).cumsum(0).tolist()[:-1]
    rows_cpu = [start + j for start, count in zip(starts, kept) for j in range(count)]
    rows = torch.tensor(rows_cpu, dtype=torch.long, device=device)
    following = torch.roll(batch.input_ids, -1)[rows]
    ends = torch.tensor(kept, dtype=torch.long).cumsum(0)  # every scheduled item keeps at least one row
    following[(ends - 1).to(device)] = last_next_tokens.to(following.dtype)
    context = ForwardBatch(
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        query_start_loc=torch.nn.functional.pad(ends, (1, 0)).to(batch.query_start_loc.dtype).to(device),
        context_lens=batch.context_lens,
        slot_ids=batch.slot_ids,
        block_tables=batch.block_tables,
        logits_indices=torch.arange(len(rows_cpu), device=device),
        query_lens_cpu=list(kept),
        context_lens_cpu=batch.context_lens_cpu,
        slot_ids_cpu=batch.slot_ids_cpu,
        block_tables_cpu=batch.block_tables_cpu,
    )
    return DraftContext(context, streams[rows], following)


def propose_sampling(
    scheduled: list[ScheduledSeq], positions: list[int], device: torch.device
) -> SamplingTensors:
    """One row per scheduled item, at the output index of its first draft."""
    seqs = [item.seq for item in scheduled]
    return SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs], positions, device)
