"""Turns a scheduled step into device work: inputs, forward, logits, sampling, logprobs.

`prepare` builds the step on the host and copies it to the device on a side stream;
`launch_forward` queues the forward on the compute stream; `launch_sampling` masks grammar-
constrained rows, queues the sampler and starts the copy of the results back to pinned host
memory (between the two the host may advance grammar matchers with the previous step's tokens);
`StepResult.read` waits for them. Sampled ids stay on the
device: a decode row whose input the host does not know yet (the previous step's sample) is
filled on the device from that step's sampled tensor, so the host never waits to launch a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.engine.grammar_bitmask import GrammarBitmask
from deepinfer_core.engine.sampler import SamplingTensors, compute_logprobs
from deepinfer_core.engine.scheduler import ScheduledSeq
from deepinfer_core.engine.sequence import PENDING, Sequence
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.interfaces import Backend

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


@dataclass(slots=True)
class LaunchedForward:
    step: PreparedStep
    logits: torch.Tensor
    start_event: Any
    launch_s: float


@dataclass(slots=True)
class HostResults:
    sampled: list[int]
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

    def read(self) -> tuple[HostResults, float]:
        """Wait for the step; return its results and the seconds the host waited."""
        waited = time.perf_counter()
        self.done.synchronize()
        waited = time.perf_counter() - waited

        def as_list(name: str) -> list | None:
            value = self.host[name]
            return None if value is None else value.tolist()

        return HostResults(
            sampled=as_list("sampled") or [],
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
    def __init__(self, model: Any, cache: Any, backend: Backend, max_num_seqs: int) -> None:
        self.model = model
        self.cache = cache
        self.ops = backend.ops()
        self.memory = backend.memory()
        self.device = backend.device
        self.copy_stream = self.memory.new_stream()
        self.max_num_seqs = max_num_seqs
        self._grammar_bitmask: GrammarBitmask | None = None

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
        for item in scheduled:
            seq, first = item.seq, len(input_ids)
            tokens = seq.token_ids[item.start:item.start + item.num_tokens]
            for offset, token in enumerate(tokens):
                if token == PENDING:
                    # Only the newest token can be in flight, and only the last step sampled it.
                    pending_rows.append(first + offset)
                    pending_sources.append(previous_rows[id(seq)])
            input_ids.extend(0 if t == PENDING else t for t in tokens)
            positions.extend(range(item.start, item.start + item.num_tokens))
            query_start.append(len(input_ids))
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
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
            )
            sampling = None
            if sampling_seqs:
                sampling = SamplingTensors.build(
                    [s.params for s in sampling_seqs], [s.seed for s in sampling_seqs],
                    output_positions, self.device,
                )
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
        hidden = self.model.forward(batch, self.cache).hidden
        for fork in step.forks:
            self.cache.copy_sequence(*fork)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return LaunchedForward(step, logits, start_event, time.perf_counter() - started)

    @torch.inference_mode()
    def launch_sampling(self, forward: LaunchedForward) -> StepResult:
        """Mask the constrained rows (every matcher must have accepted all earlier tokens), sample,
        compute logprobs on the unmasked logits and start the copies to the host."""
        started = time.perf_counter()
        step, logits, start_event = forward.step, forward.logits, forward.start_event
        compute = self.memory.current_stream()
        end_event = self.memory.new_event(True)
        num_sampled = len(step.sampling_seqs)
        sample_logits, prompt_logits = logits[:num_sampled], logits[num_sampled:]
        masked_logits = sample_logits
        if step.constrained and self._fill_grammar_bitmask(step.sampling_seqs):
            masked_logits = sample_logits.clone()
            self._grammar_bitmask.apply(masked_logits)

        host: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("sampled", "logprobs", "top_logprobs", "top_ids",
             "prompt_logprobs", "prompt_top_logprobs", "prompt_top_ids")
        )
        sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        if step.sampling is not None:
            s = step.sampling
            if s.all_greedy:
                sampled = masked_logits.argmax(dim=-1)
            else:
                sampled = self.ops.sample(
                    masked_logits, s.temperature, s.seeds, s.positions, s.top_k, s.top_p, s.min_p
                )
            host["sampled"] = sampled
            if any(seq.params.logprobs is not None for seq in step.sampling_seqs):
                host["logprobs"], host["top_logprobs"], host["top_ids"] = compute_logprobs(
                    sample_logits, sampled, step.num_logprobs
                )
        if step.prompt_lp_targets is not None:
            host["prompt_logprobs"], host["prompt_top_logprobs"], host["prompt_top_ids"] = (
                compute_logprobs(prompt_logits, step.prompt_lp_targets, step.num_prompt_logprobs)
            )
        end_event.record(compute)
        host = {name: self._to_host(value) for name, value in host.items()}
        done = self.memory.new_event()
        done.record(compute)
        launch_s = forward.launch_s + time.perf_counter() - started
        return StepResult(step, sampled, host, done, launch_s, start_event, end_event)

    def _fill_grammar_bitmask(self, seqs: list[Sequence]) -> int:
        """Host side of the grammar masks; returns how many rows are constrained."""
        if self._grammar_bitmask is None:
            self._grammar_bitmask = GrammarBitmask(
                self.model.config.vocab_size, self.max_num_seqs, host_buffer=self.memory.pinned_buffer
            )
        matchers = []
        for seq in seqs:
            if seq.grammar is None and seq.pending_grammar is not None:
                seq.grammar = seq.pending_grammar.new_matcher()  # waits if still compiling
            matchers.append(None if seq.is_finished else seq.grammar)
        return self._grammar_bitmask.fill(matchers)

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
