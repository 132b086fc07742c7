"""The engine's side of speculative decoding: one step verifies every sequence's drafts and drafts anew.

A sampling sequence with n drafts owns 1 + n consecutive logits rows (its last token, then the
drafts); one without drafts owns one row, so `verify` handles both (no drafts = a plain draw).
After verification the main model's rings are rolled back to the accepted positions, and the
drafter sees one `DraftContext` over the step's kept rows: every row of a prefill chunk, the last
token and the accepted drafts of a verifying sequence. Each kept row is followed by the token at
the next position: the next row's input, and after a sequence's last kept row the token the step
emitted (or, for a prefill chunk that is not the prompt's last, the next chunk's first token).

`load_draft_layers` / `build_drafter` pick the drafter for the method and model family (V4's MTP,
V4.1's DSpark) and `target_rollback` the target cache's rollback (V4's rings; V4.1's rings, open
groups and engram look-back, models/deepseek_v41/rollback.py).

NOTE: the engine reads each speculative step's results before it schedules the next one (drafts
decide the next step's shape), so with speculation the host does not overlap the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.engine.scheduler import ScheduledSeq
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.deepseek_v4.rollback import RingSnapshot, ring_tensors
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.speculative import (
    Draft,
    DraftContext,
    Drafter,
    MtpDrafter,
    SpeculativeConfig,
)

__all__ = [
    "SpeculativeMethodMismatch",
    "SpeculativePlan",
    "build_drafter",
    "kept_context",
    "load_draft_layers",
    "plan_step",
    "propose_sampling",
    "step_draft",
    "target_rollback",
]


class SpeculativeMethodMismatch(ValueError):
    """The speculative method does not match the checkpoint's draft layers."""


def load_draft_layers(model, config: SpeculativeConfig, checkpoint_dir: str | Path):
    """The draft layers `config.method` needs beyond the model's own, loaded from `checkpoint_dir` (call
    it before planning the KV pool, so the pool is sized after them): DeepSeek-V4.1's DSpark layers
    (a `DSpark`), or None for MTP, which is part of the V4 model. Raises SpeculativeMethodMismatch
    when the method is the other model family's, DSparkUnavailable when the checkpoint has no DSpark."""
    _check_model_family(model, config)
    if config.method == "mtp":
        return None
    from deepinfer_core.models.deepseek_v41.dspark import DSpark, DSparkUnavailable
    from deepinfer_core.weights.errors import CheckpointMismatch
    from deepinfer_core.weights.loader import load_model_weights

    dspark = DSpark(model.config, model, model.ops, model.dtype, model.device, kv_cache_dtype=model.kv_cache_dtype)
    try:
        load_model_weights(dspark, checkpoint_dir, prefixes=("mtp.",))
    except CheckpointMismatch as err:
        raise DSparkUnavailable(f"cannot load the DSpark drafter (`mtp.*`) from {checkpoint_dir}: {err}") from err
    return dspark.eval()


def build_drafter(
    model, cache, config: SpeculativeConfig, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    draft_layers=None,
) -> Drafter:
    """The drafter of `config.method` over `model` and its `cache`: DeepSeek-V4's MTP layer, or
    DeepSeek-V4.1's DSpark layers from `load_draft_layers` (their window cache allocated here).
    Raises MtpUnavailable / DSparkUnavailable when the drafter cannot run."""
    _check_model_family(model, config)
    if config.method == "mtp":
        return MtpDrafter(model, cache, config)
    from deepinfer_core.models.deepseek_v41.dspark import DSparkCache, DSparkUnavailable
    from deepinfer_core.speculative.dspark_drafter import DSparkDrafter

    if draft_layers is None:
        raise DSparkUnavailable("method='dspark' needs the DSpark layers: load them with `load_draft_layers`")
    drafter_cache = DSparkCache(model.config, num_slots=cache.num_slots, dtype=model.dtype, allocate=allocate,
                                kv_cache_dtype=model.kv_cache_dtype)
    return DSparkDrafter(draft_layers, drafter_cache, config)


def _check_model_family(model, config: SpeculativeConfig) -> None:
    from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM

    v41 = isinstance(model, DeepseekV41ForCausalLM)
    if config.method == "mtp" and v41:
        raise SpeculativeMethodMismatch(
            "method='mtp' drafts with DeepSeek-V4's MTP layer, but this is a DeepSeek-V4.1 checkpoint, whose "
            "draft layers are DSpark's: use SpeculativeConfig(method='dspark', ...)"
        )
    if config.method == "dspark" and not v41:
        raise SpeculativeMethodMismatch(
            f"method='dspark' needs a DeepSeek-V4.1 checkpoint (its `mtp.*` DSpark layers), but the model is "
            f"{type(model).__name__}: use SpeculativeConfig(method='mtp', ...) for DeepSeek-V4"
        )


class _RingRollback:
    """DeepSeek-V4: every per-slot ring of the main layers (rollback.py there)."""

    lookback = 0

    def __init__(self, rings: list[torch.Tensor]) -> None:
        self.rings = rings

    def take(self, batch: ForwardBatch, lengths: list[int]) -> _RingStep:
        return _RingStep(RingSnapshot.take(self.rings, batch.slot_ids_cpu, batch.context_lens_cpu, lengths))


@dataclass(slots=True)
class _RingStep:
    snapshot: RingSnapshot

    def restore(self, kept: torch.Tensor, tails: list[list[int]] = ()) -> None:
        self.snapshot.restore(kept)


def target_rollback(model, cache):
    """The target's rollback of a verification step: `take(batch, lengths)` before the step returns a
    snapshot whose `restore(kept, tails)` keeps the first kept[i] positions of sequence i; `tails[i]`
    are its last `lookback` accepted tokens (DeepSeek-V4.1's engram look-back)."""
    from deepinfer_core.models.deepseek_v41 import DeepseekV41Cache

    if isinstance(cache, DeepseekV41Cache):
        from deepinfer_core.models.deepseek_v41.rollback import StepRollback

        return StepRollback(model, cache)
    return _RingRollback(ring_tensors(cache.layers[: model.config.num_hidden_layers]))


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
