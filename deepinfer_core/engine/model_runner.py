"""Turns a scheduled step into device work: inputs, forward, logits, sampling, logprobs.

`prepare` builds the step on the host and copies it to the device on a side stream;
`launch_forward` queues the forward on the compute stream; `launch_sampling` masks grammar-
constrained rows, queues the sampler and starts the copy of the results back to pinned host
memory (between the two the host may advance grammar matchers with the previous step's tokens);
`StepResult.read` waits for them. With speculative decoding (speculation.py) the sampling step
verifies the drafts, rolls rejected positions back and has the drafter propose the next drafts.
Sampled ids stay on the
device: a decode row whose input the host does not know yet (the previous step's sample) is
filled on the device from that step's sampled tensor, so the host never waits to launch a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.grammar_bitmask import GrammarBitmask
from deepinfer_core.engine.prefix_cache import restore_slot_state
from deepinfer_core.engine.sampler import SamplingTensors, compute_logprobs
from deepinfer_core.engine.scheduler import ScheduledSeq
from deepinfer_core.engine.sequence import PENDING, Sequence
from deepinfer_core.engine.speculation import (
    SpeculativePlan,
    build_drafter,
    kept_context,
    plan_step,
    propose_sampling,
    target_rollback,
)
from deepinfer_core.models.deepseek_v41.image_span import StepImages
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.interfaces import Backend
from deepinfer_core.speculative import (
    Draft,
    SpeculativeConfig,
    Verification,
    verify,
)

__all__ = ["ModelRunner", "PreparedStep", "LaunchedForward", "StepResult", "HostResults"]


@dataclass(slots=True)
class PreparedStep:
    scheduled: list[ScheduledSeq]
    batch: ForwardBatch
    sampling_seqs: list[Sequence]
    sampling: SamplingTensors | None
    forks: list[tuple[int, int, list[int], list[int]]]  # (src slot, dst slot, src blocks, dst blocks)
    prompt_lp_seqs: list[tuple[Sequence, int]]     # (sequence, prompt position scored) per row
    prompt_lp_targets: torch.Tensor | None
    pending_rows: torch.Tensor | None               # rows of input_ids to take from the last step
    pending_sources: torch.Tensor | None            # their indices in the last step's samples
    num_logprobs: int
    num_prompt_logprobs: int
    ready: Any                                      # event: the inputs are on the device
    prepare_s: float
    constrained: bool                               # some sampling row follows a grammar
    num_sample_rows: int                            # logits rows of the sampling sequences (1 + drafts each)
    speculative: SpeculativePlan | None = None
    images: StepImages | None = None                # V4.1: the step's image-span rows and vectors


@dataclass(slots=True)
class LaunchedForward:
    step: PreparedStep
    logits: torch.Tensor
    start_event: Any
    launch_s: float
    streams: torch.Tensor | None = None             # speculative: the drafter's input
    snapshot: Any = None                            # speculative: target state the verified positions overwrote


@dataclass(slots=True)
class HostResults:
    emitted: list[list[int]]                        # per sampling sequence, in order (one token without drafts)
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None
    prompt_logprobs: list[float] | None
    prompt_top_logprobs: list[list[float]] | None
    prompt_top_ids: list[list[int]] | None


@dataclass(slots=True)
class StepResult:
    step: PreparedStep
    sampled: torch.Tensor                           # [num sampling rows] int64 on the device
    host: dict[str, torch.Tensor | None]            # pinned copies, valid once `done` completes
    done: Any
    launch_s: float
    start_event: Any
    end_event: Any
    num_accepted: list[int] | None = None           # speculative: drafts accepted per sampling sequence
    drafts: list[tuple[list[int], torch.Tensor | None]] | None = None  # speculative: next drafts, probs

    def read(self) -> tuple[HostResults, float]:
        """Wait for the step; return its results and the seconds the host waited."""
        waited = time.perf_counter()
        self.done.synchronize()
        waited = time.perf_counter() - waited

        def as_list(name: str) -> list | None:
            value = self.host[name]
            return None if value is None else value.tolist()

        sampled = as_list("sampled") or []
        if self.num_accepted is None:
            emitted = [[token] for token in sampled]
        else:
            emitted = [row[:accepted + 1] for row, accepted in zip(sampled, self.num_accepted)]
        return HostResults(
            emitted=emitted,
            logprobs=as_list("logprobs"),
            top_logprobs=as_list("top_logprobs"),
            top_ids=as_list("top_ids"),
            prompt_logprobs=as_list("prompt_logprobs"),
            prompt_top_logprobs=as_list("prompt_top_logprobs"),
            prompt_top_ids=as_list("prompt_top_ids"),
        ), waited

    def device_seconds(self) -> float | None:
        """Device time of the step where the backend's events can time it."""
        elapsed = getattr(self.start_event, "elapsed_time", None)
        return None if elapsed is None else elapsed(self.end_event) / 1000.0


class ModelRunner:
    def __init__(
        self, model: Any, cache: Any, backend: Backend, max_num_seqs: int,
        speculative: SpeculativeConfig | None = None, draft_layers: Any = None,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.decode_graphs = decode_graphs  # replays plain decode steps (engine/decode_graphs.py)
        self.cache = cache
        self.ops = model.ops  # the model's own ops object: it carries the engine's batch-invariant mode
        self.memory = backend.memory()
        self.device = backend.device
        self.copy_stream = self.memory.new_stream()
        self.max_num_seqs = max_num_seqs
        self._grammar_bitmask: GrammarBitmask | None = None
        self.speculative = speculative
        # Raises MtpUnavailable / DSparkUnavailable for a checkpoint without draft layers or rings too
        # short for k, SpeculativeMethodMismatch for the other model family's method.
        self.drafter = None
        if speculative is not None:
            self.drafter = build_drafter(model, cache, speculative, self.memory.allocate, draft_layers)
        self._rollback = None if speculative is None else target_rollback(model, cache)

    def prepare(self, scheduled: list[ScheduledSeq], previous: StepResult | None) -> PreparedStep:
        started = time.perf_counter()
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        previous_rows = (
            {id(seq): row for row, seq in enumerate(previous.step.sampling_seqs)} if previous else {}
        )
        logits_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        output_positions: list[int] = []
        prompt_rows: list[int] = []
        prompt_lp_seqs: list[tuple[Sequence, int]] = []
        prompt_targets: list[int] = []
        forks: list[tuple[int, int, list[int], list[int]]] = []
        image_rows: list[int] = []
        image_vectors: list[torch.Tensor] = []
        for item in scheduled:
            seq, first = item.seq, len(input_ids)
            if seq.images is not None:
                offsets, vectors = seq.images.rows_between(item.start, item.start + item.num_tokens)
                image_rows.extend(first + offset for offset in offsets)
                image_vectors.extend(vectors)
            if item.prefix_hit:  # queued before this step's forward (V4.1's engram hash reads the look-back)
                restore_slot_state(self.model, self.cache, seq.slot_id, item.restore_slot, seq.token_ids, item.start)
            tokens = seq.token_ids[item.start:item.start + item.num_tokens - len(item.draft)] + item.draft
            for offset, token in enumerate(tokens):
                if token == PENDING:
                    # Only the newest token can be in flight, and only the last step sampled it.
                    pending_rows.append(first + offset)
                    pending_sources.append(previous_rows[id(seq)])
            input_ids.extend(0 if t == PENDING else t for t in tokens)
            positions.extend(range(item.start, item.start + item.num_tokens))
            query_start.append(len(input_ids))
            if item.samples:  # the last token's row, and one row per draft
                logits_rows.extend(range(len(input_ids) - 1 - len(item.draft), len(input_ids)))
                sampling_seqs.append(seq)
                output_positions.append(seq.num_output_tokens - 1)
            for fork in item.forks:  # its first token comes from the same logits, with its own seed
                logits_rows.append(len(input_ids) - 1)
                sampling_seqs.append(fork)
                output_positions.append(0)
                n = len(fork.block_table)
                forks.append((seq.slot_id, fork.slot_id, seq.block_table[:n], list(fork.block_table)))
            if seq.wants_prompt_logprobs:
                for position in range(item.start, item.start + item.num_tokens):
                    scored = position + 1
                    if len(seq.prompt_logprobs) <= scored < seq.num_prompt_tokens:
                        prompt_rows.append(first + position - item.start)
                        prompt_lp_seqs.append((seq, scored))
                        prompt_targets.append(seq.token_ids[scored])

        with self.memory.use_stream(self.copy_stream):
            batch = ForwardBatch(
                input_ids=self._to_device(input_ids, torch.int64),
                positions=self._to_device(positions, torch.int64),
                query_start_loc=self._to_device(query_start, torch.int32),
                context_lens=self._to_device([s.start for s in scheduled], torch.int32),
                slot_ids=self._to_device([s.seq.slot_id for s in scheduled], torch.int32),
                block_tables=self._block_tables(scheduled),
                logits_indices=self._to_device(logits_rows + prompt_rows, torch.int64),
                query_lens_cpu=[s.num_tokens for s in scheduled],
                context_lens_cpu=[s.start for s in scheduled],
                slot_ids_cpu=[s.seq.slot_id for s in scheduled],
                block_tables_cpu=[list(s.seq.block_table) for s in scheduled],
                **_replay_bounds(scheduled),
            )
            sampling = None
            if sampling_seqs:
                sampling = SamplingTensors.build(
                    [s.params for s in sampling_seqs], [s.seed for s in sampling_seqs],
                    output_positions, self.device,
                )
            speculative = None
            if self.drafter is not None:
                speculative = plan_step(scheduled, sampling_seqs, self.model.config.vocab_size, self.device)
            images = None
            if image_rows:
                images = StepImages(self._to_device(image_rows, torch.int64), image_rows, torch.cat(image_vectors))
            ready = self.memory.new_event()
            ready.record(self.copy_stream)
        return PreparedStep(
            scheduled=scheduled,
            batch=batch,
            sampling_seqs=sampling_seqs,
            sampling=sampling,
            forks=forks,
            prompt_lp_seqs=prompt_lp_seqs,
            prompt_lp_targets=self._to_device(prompt_targets, torch.int64) if prompt_targets else None,
            pending_rows=self._to_device(pending_rows, torch.int64) if pending_rows else None,
            pending_sources=self._to_device(pending_sources, torch.int64) if pending_rows else None,
            num_logprobs=max((s.params.logprobs or 0 for s in sampling_seqs), default=0),
            num_prompt_logprobs=max((s.params.prompt_logprobs or 0 for s, _ in prompt_lp_seqs), default=0),
            ready=ready,
            prepare_s=time.perf_counter() - started,
            constrained=any(seq.pending_grammar is not None for seq in sampling_seqs),
            num_sample_rows=len(logits_rows),
            speculative=speculative,
            images=images,
        )

    @torch.inference_mode()
    def launch_forward(self, step: PreparedStep, previous: StepResult | None) -> LaunchedForward:
        """Queue the forward and the logits; sampling waits for `launch_sampling`, so that the
        host can first advance the grammar matchers with the previous step's tokens."""
        started = time.perf_counter()
        compute = self.memory.current_stream()
        compute.wait_event(step.ready)
        start_event = self.memory.new_event(True)
        start_event.record(compute)
        batch = step.batch
        if step.pending_rows is not None:
            batch.input_ids[step.pending_rows] = previous.sampled[step.pending_sources]
        snapshot = None
        if step.speculative is not None:
            verified = [1 + len(item.draft) if item.draft else 0 for item in step.scheduled]
            snapshot = self._rollback.take(batch, verified)
        if self._replayable(step):
            logits = self.decode_graphs.logits(batch)
            return LaunchedForward(step, logits, start_event, time.perf_counter() - started)
        images = {} if step.images is None else {"images": step.images}
        out = self.model.forward(batch, self.cache, **images)
        for fork in step.forks:
            self.cache.copy_sequence(*fork)
        for item in step.scheduled:  # exact prefix reuse: the window state at the end of this chunk
            if item.snapshot_slot >= 0:
                self.cache.copy_sequence(item.seq.slot_id, item.snapshot_slot, [], [])
        logits = self.model.compute_logits(out.hidden[batch.logits_indices])
        return LaunchedForward(step, logits, start_event, time.perf_counter() - started,
                               self.drafter.target_features(out) if snapshot is not None else None, snapshot)

    def _replayable(self, step: PreparedStep) -> bool:
        """A plain decode step: no forks, snapshots, prompt log-probs or images (speculation builds no graphs)."""
        return (self.decode_graphs is not None and step.images is None and not step.forks
                and not step.prompt_lp_seqs and all(item.snapshot_slot < 0 for item in step.scheduled)
                and self.decode_graphs.covers(step.batch))

    @torch.inference_mode()
    def launch_sampling(self, forward: LaunchedForward) -> StepResult:
        """Mask the constrained rows (every matcher must have accepted all earlier tokens), sample,
        compute logprobs on the unmasked logits and start the copies to the host."""
        started = time.perf_counter()
        step, logits, start_event = forward.step, forward.logits, forward.start_event
        compute = self.memory.current_stream()
        end_event = self.memory.new_event(True)
        num_sampled = step.num_sample_rows
        sample_logits, prompt_logits = logits[:num_sampled], logits[num_sampled:]
        masked_logits = sample_logits
        spec = step.speculative
        drafts = None if spec is None else [seq.draft_token_ids[:n] for seq, n in
                                            zip(step.sampling_seqs, spec.draft_lengths)]
        if step.constrained and self._fill_grammar_bitmask(step.sampling_seqs, drafts):
            masked_logits = sample_logits.clone()
            self._grammar_bitmask.apply(masked_logits)

        host: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("sampled", "logprobs", "top_logprobs", "top_ids",
             "prompt_logprobs", "prompt_top_logprobs", "prompt_top_ids")
        )
        sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        verification = None
        if step.sampling is not None:
            s = step.sampling
            if spec is not None:
                verification = verify(masked_logits, spec.draft, s, self.ops.sample)
                sampled = verification.tokens
                row_tokens = sampled[spec.row_seqs, spec.row_offsets].clamp(min=0)
            elif s.all_greedy:
                sampled = row_tokens = masked_logits.argmax(dim=-1)
            else:
                sampled = row_tokens = self.ops.sample(
                    masked_logits, s.temperature, s.seeds, s.positions, s.top_k, s.top_p, s.min_p
                )
            host["sampled"] = sampled
            if any(seq.params.logprobs is not None for seq in step.sampling_seqs):
                host["logprobs"], host["top_logprobs"], host["top_ids"] = compute_logprobs(
                    sample_logits, row_tokens, step.num_logprobs
                )
        if step.prompt_lp_targets is not None:
            host["prompt_logprobs"], host["prompt_top_logprobs"], host["prompt_top_ids"] = (
                compute_logprobs(prompt_logits, step.prompt_lp_targets, step.num_prompt_logprobs)
            )
        num_accepted, next_drafts = None, None
        if spec is not None:
            num_accepted, next_drafts = self._draft_next(forward, verification)
        end_event.record(compute)
        host = {name: self._to_host(value) for name, value in host.items()}
        done = self.memory.new_event()
        done.record(compute)
        launch_s = forward.launch_s + time.perf_counter() - started
        return StepResult(step, sampled, host, done, launch_s, start_event, end_event, num_accepted, next_drafts)

    def _draft_next(
        self, forward: LaunchedForward, verification: Verification | None
    ) -> tuple[list[int], list[tuple[list[int], torch.Tensor | None]]]:
        """Roll the rejected positions back, then have the drafter see the kept rows and propose.
        Reads the accepted counts on the host: the next step's shape depends on them."""
        step, spec = forward.step, forward.step.speculative
        accepted = [] if verification is None else verification.num_accepted.tolist()
        kept, last_tokens, positions, max_drafts = [], [], [], []
        k = self.speculative.num_draft_tokens
        for item, row, before, next_prompt_token in zip(
            step.scheduled, spec.sampling_index, spec.tokens_before, spec.next_prompt_token
        ):
            if row < 0:  # a prefill chunk that is not the prompt's last: no token, no drafts
                kept.append(item.num_tokens)
                last_tokens.append(next_prompt_token)
                positions.append(0)
                max_drafts.append(0)
                continue
            emitted = accepted[row] + 1
            kept.append(item.num_tokens - len(item.draft) + accepted[row])
            last_tokens.append(-1)
            positions.append(before - item.seq.num_prompt_tokens + emitted)
            max_drafts.append(max(0, min(k, item.seq.max_num_tokens - (before + emitted) - 1)))
        restore = [1 + accepted[row] if item.draft else 0 for item, row in zip(step.scheduled, spec.sampling_index)]
        forward.snapshot.restore(torch.tensor(restore, dtype=torch.long), self._accepted_tails(step, accepted))
        last = torch.tensor(last_tokens, dtype=torch.long, device=self.device)
        if verification is not None:
            index = torch.tensor([max(r, 0) for r in spec.sampling_index], dtype=torch.long, device=self.device)
            final = verification.tokens[index, verification.num_accepted[index]]
            last = torch.where(last < 0, final, last)
        context = kept_context(step.batch, forward.streams, kept, last)
        draft = self.drafter.propose(context, propose_sampling(step.scheduled, positions, self.device), max_drafts)
        return accepted, self._drafts_per_sampling_seq(draft, spec.sampling_index, len(step.sampling_seqs))

    def _accepted_tails(self, step: PreparedStep, accepted: list[int]) -> list[list[int]]:
        """Per scheduled item, its last `lookback` tokens up to the last accepted one (the target's
        rollback rebuilds V4.1's engram look-back from them)."""
        n = self._rollback.lookback
        tails = []
        for item, row in zip(step.scheduled, step.speculative.sampling_index):
            if not n or not item.draft:
                tails.append([])
                continue
            end = item.start + 1  # the verified rows: the last token at `start`, then the drafts
            tails.append((item.seq.token_ids[max(0, end - n):end] + item.draft[:accepted[row]])[-n:])
        return tails

    @staticmethod
    def _drafts_per_sampling_seq(
        draft: Draft, sampling_index: list[int], num_seqs: int
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        lengths, tokens = draft.lengths.tolist(), draft.tokens.tolist()
        drafts: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * num_seqs
        for item, row in enumerate(sampling_index):
            if row >= 0:
                n = lengths[item]
                drafts[row] = (tokens[item][:n], None if draft.probs is None else draft.probs[item, :n])
        return drafts

    def _fill_grammar_bitmask(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> int:
        """Host side of the grammar masks (with drafts: 1 + len(drafts[i]) rows for seqs[i]);
        returns how many rows are constrained."""
        if self._grammar_bitmask is None:
            rows_per_seq = 1 + (self.speculative.num_draft_tokens if self.speculative else 0)
            self._grammar_bitmask = GrammarBitmask(
                self.model.config.vocab_size, self.max_num_seqs * rows_per_seq,
                host_buffer=self.memory.pinned_buffer,
            )
        matchers = []
        for seq in seqs:
            if seq.grammar is None and seq.pending_grammar is not None:
                seq.grammar = seq.pending_grammar.new_matcher()  # waits if still compiling
            matchers.append(None if seq.is_finished else seq.grammar)
        return self._grammar_bitmask.fill(matchers, drafts)

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        staging = self.memory.pinned_buffer((len(values),), dtype)
        staging.copy_(torch.tensor(values, dtype=dtype))
        return staging.to(self.device, non_blocking=True)

    def _to_host(self, value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        staging = self.memory.pinned_buffer(tuple(value.shape), value.dtype)
        return staging.copy_(value, non_blocking=True)

    def _block_tables(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        width = max(len(s.seq.block_table) for s in scheduled)
        rows = [s.seq.block_table + [-1] * (width - len(s.seq.block_table)) for s in scheduled]
        staging = self.memory.pinned_buffer((len(rows), width), torch.int32)
        staging.copy_(torch.tensor(rows, dtype=torch.int32))
        return staging.to(self.device, non_blocking=True)


def _replay_bounds(scheduled: list[ScheduledSeq]) -> dict[str, list[int]]:
    """ForwardBatch's bounded-replay fields, where some sequence of the step needs them."""
    bounds = {}
    if any(s.seq.window_start for s in scheduled):
        bounds["window_starts_cpu"] = [s.seq.window_start for s in scheduled]
    if any(s.start < s.seq.reused_len for s in scheduled):
        bounds["reused_lens_cpu"] = [s.seq.reused_len for s in scheduled]
    return bounds
