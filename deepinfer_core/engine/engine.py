"""The step loop: schedule, launch, and turn sampled tokens into request outputs.

With asynchronous scheduling the loop launches step N+1 before it reads step N's tokens, so the
host's scheduling and input preparation overlap the device's work; a sequence that step N
finished was already scheduled in step N+1, whose token for it is discarded. Without it, every
step is read before the next is scheduled. Both give the same tokens: sampling is keyed on
(seed, output position), never on the step. With speculative decoding every step is read before
the next is scheduled (the drafts it proposed shape the next step), and a step may emit several
tokens per sequence: its accepted drafts, then the target's own token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.grammar import PendingGrammar
from deepinfer_core.engine.images import PromptImages
from deepinfer_core.engine.kv_cache import KVPoolTooSmallError
from deepinfer_core.engine.model_runner import ModelRunner, StepResult
from deepinfer_core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_core.engine.sampler import derive_seed
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import ScheduledSeq, Scheduler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.speculative import SpeculativeStats

__all__ = ["LLMEngine", "StepStats", "EngineStats"]


@dataclass(slots=True)
class StepStats:
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int     # positions decode sequences computed: 1 + drafts verified each, with speculation
    host_s: float          # scheduling, input preparation and output processing
    launch_s: float        # queueing the step (the whole step where the device runs synchronously)
    wait_s: float          # the host blocked on the device
    device_s: float | None  # device time from the backend's timing events, where it has them


# Steps kept one by one for inspection; the totals cover every step, so a long run keeps constant memory.
RECENT_STEPS = 4096


@dataclass(slots=True)
class EngineStats:
    """Totals over every step of the engine, and its last RECENT_STEPS steps one by one (`recent`)."""

    recent: deque[StepStats] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seqs_stepped: int = 0            # sequences summed over steps
    host_s: float = 0.0
    wait_s: float = 0.0
    prefill_device_s: float = 0.0    # steps with prefill tokens
    decode_device_s: float = 0.0     # steps with decode tokens only
    num_preemptions: int = 0
    speculative: SpeculativeStats | None = None

    def record(self, step: StepStats) -> None:
        self.recent.append(step)
        self.num_steps += 1
        self.prefill_tokens += step.prefill_tokens
        self.decode_tokens += step.decode_tokens
        self.seqs_stepped += step.num_seqs
        self.host_s += step.host_s
        self.wait_s += step.wait_s
        self._add_device(step, 1.0)

    def timed(self, step: StepStats, device_s: float | None) -> None:
        """A recorded step's device time, known only once its timing events completed."""
        self._add_device(step, -1.0)
        step.device_s = device_s
        self._add_device(step, 1.0)

    def _add_device(self, step: StepStats, sign: float) -> None:
        # until (or unless) the backend times the step, the time it took to queue it stands in
        seconds = sign * (step.device_s if step.device_s is not None else step.launch_s)
        if step.prefill_tokens:
            self.prefill_device_s += seconds
        else:
            self.decode_device_s += seconds

    def summary(self) -> dict[str, float]:
        """Per-step means and totals. With speculation, `spec_*` counts drafts verified and drafts
        accepted as output tokens (a draft after a stop is not counted), per sequence-step."""
        n = max(self.num_steps, 1)
        return {
            "steps": self.num_steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_device_s if self.prefill_device_s else 0.0,
            "decode_tokens_per_s": self.decode_tokens / self.decode_device_s if self.decode_device_s else 0.0,
            "mean_batch_size": self.seqs_stepped / n,
            "host_ms_per_step": 1e3 * self.host_s / n,
            "device_ms_per_step": 1e3 * (self.prefill_device_s + self.decode_device_s) / n,
            "wait_ms_per_step": 1e3 * self.wait_s / n,
            "preemptions": self.num_preemptions,
        } | self._speculative_summary()

    def _speculative_summary(self) -> dict[str, float]:
        spec = self.speculative
        if spec is None:
            return {}
        per_position = {f"spec_acceptance_rate_pos{j}": rate
                        for j, rate in enumerate(spec.acceptance_rate_per_position)}
        return {
            "spec_draft_tokens": spec.num_drafted,
            "spec_accepted_tokens": spec.num_accepted,
            "spec_acceptance_rate": spec.acceptance_rate,
            "spec_mean_accepted_length": spec.mean_accepted_drafts,
            "spec_tokens_per_step": spec.tokens_per_step,
        } | per_position


@dataclass(slots=True, eq=False)
class _Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]


class LLMEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_model_len: int,
        seed: int,
        async_scheduling: bool,
        fork_prompts: bool,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seed = seed
        speculative = runner.speculative is not None
        self.async_scheduling = async_scheduling and not speculative
        self.fork_prompts = fork_prompts
        self.stats = EngineStats(speculative=SpeculativeStats() if speculative else None)
        self._requests: dict[int, _Request] = {}
        self._num_requests = 0
        self._num_seqs = 0
        self._in_flight: StepResult | None = None
        self._untimed: dict[int, StepStats] = {}

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: PendingGrammar | None = None,
        request_id: int | None = None,
        images: PromptImages | None = None,
    ) -> int:
        """Queue a validated request; returns its id (also the index its unseeded seed derives from).

        `request_id` defaults to the next unused one; a data-parallel front passes each request's
        global index, so a rank samples it exactly as a single engine would. `images`: the request's
        image spans (the prompt already widened) and their vectors, shared by its sequences."""
        if request_id is None:
            request_id = self._num_requests
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id} is already queued; pass an unused id or none")
        self._num_requests = max(self._num_requests, request_id + 1)
        base_seed = params.seed if params.seed is not None else derive_seed(self.seed, request_id)
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=self._num_seqs,
                request_id=request_id,
                index=index,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                max_num_tokens=min(len(prompt_token_ids) + params.max_tokens, self.max_model_len),
                params=params,
                seed=base_seed if index == 0 else derive_seed(base_seed, index),
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop),
                pending_grammar=grammar,
                images=images,
            )
            self._num_seqs += 1
            seqs.append(seq)
        if self.fork_prompts:
            seqs[0].forks = seqs[1:]  # prefilled once, then forked (see scheduler)
            self.scheduler.add(seqs[0])
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self._requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), seqs)
        return request_id

    def abort(self, request_id: int) -> None:
        """Stop a request now; it is dropped without an output."""
        request = self._requests.pop(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it."""
        started = time.perf_counter()
        host_s = launch_s = wait_s = 0.0
        scheduled = self.scheduler.schedule()
        launched = None
        finished: list[RequestOutput] = []
        if scheduled:
            prepared = self.runner.prepare(scheduled, self._in_flight)
            forward = self.runner.launch_forward(prepared, self._in_flight)
            if prepared.constrained and self._in_flight is not None:
                # This step's grammar masks need the in-flight step's tokens: read them while the
                # device runs this step's forward.
                wait_s += self._process(self._in_flight, finished)
                self._in_flight = None
            launched = self.runner.launch_sampling(forward)
            launch_s = launched.launch_s
        elif self._in_flight is None:
            raise KVPoolTooSmallError(
                "the scheduler found nothing to run while requests are unfinished: the KV pool "
                "cannot hold the next waiting sequence; raise num_kv_blocks or kv_cache_memory_fraction"
            )
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            wait_s += self._process(previous, finished)
        if not self.async_scheduling and self._in_flight is not None:
            wait_s += self._process(self._in_flight, finished)
            self._in_flight = None
        if not self._requests and self._in_flight is not None:
            wait_s += self._process(self._in_flight, finished)  # every token it computed is surplus
            self._in_flight = None
        if launched is not None:
            host_s = time.perf_counter() - started - launch_s - wait_s
            stats = StepStats(
                num_seqs=len(scheduled),
                prefill_tokens=sum(s.num_tokens for s in scheduled if not _is_decode(s)),
                decode_tokens=sum(s.num_tokens for s in scheduled if _is_decode(s)),
                host_s=host_s,
                launch_s=launch_s,
                wait_s=wait_s,
                device_s=launched.device_seconds() if self._in_flight is None else None,
            )
            self.stats.record(stats)
            if self._in_flight is not None:
                self._untimed[id(launched)] = stats
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return finished

    def _process(self, result: StepResult, finished: list[RequestOutput]) -> float:
        host, waited = result.read()
        stats = self._untimed.pop(id(result), None)
        if stats is not None:
            self.stats.timed(stats, result.device_seconds())  # its timing events are complete only now
        spec = result.step.speculative
        for index, seq in enumerate(result.step.sampling_seqs):
            if seq.is_finished:
                continue  # finished one step earlier; this token was computed in vain
            first_row = index if spec is None else spec.first_rows[index]
            emitted = 0
            for offset, token in enumerate(host.emitted[index]):
                if offset == 0:
                    seq.resolve_pending(token)
                else:
                    seq.append_accepted(token)
                emitted += 1
                if seq.grammar is not None and not seq.grammar.accept(token):
                    raise RuntimeError(
                        f"sequence {seq.seq_id} sampled token {token}, which its grammar forbids: the "
                        "grammar mask was not applied to its logits row"
                    )
                if seq.logprobs is not None:
                    row = first_row + offset
                    seq.logprobs.append(_logprob_dict(
                        token, host.logprobs[row], host.top_ids, host.top_logprobs, row, seq.params.logprobs
                    ))
                self._check_finished(seq, token)
                if seq.is_finished:
                    break
            if spec is not None:
                self._record_speculation(seq, result, index, emitted)
        for row, (seq, position) in enumerate(result.step.prompt_lp_seqs):
            if not seq.is_finished and len(seq.prompt_logprobs) == position:
                seq.prompt_logprobs.append(
                    _logprob_dict(seq.token_ids[position], host.prompt_logprobs[row], host.prompt_top_ids,
                                  host.prompt_top_logprobs, row, seq.params.prompt_logprobs)
                )
        for seq in result.step.sampling_seqs:
            request = self._requests.get(seq.request_id)
            if request is not None and all(s.is_finished for s in request.seqs):
                finished.append(self._request_output(self._requests.pop(seq.request_id)))
        return waited

    def _record_speculation(self, seq: Sequence, result: StepResult, index: int, emitted: int) -> None:
        verified = result.step.speculative.draft_lengths[index]
        accepted = min(result.num_accepted[index], emitted)  # accepted drafts that became output
        seq.num_draft_tokens += verified
        seq.num_accepted_tokens += accepted
        self.stats.speculative.record([verified], [accepted])
        if not seq.is_finished:
            seq.set_draft(*result.drafts[index])

    def _check_finished(self, seq: Sequence, token: int) -> None:
        params = seq.params
        reason, stop_reason = None, None
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif seq.grammar is not None and seq.grammar.is_terminated():
            reason, stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason, stop_reason = "stop", token
        else:
            stop_string = seq.detokenizer.add_token(token)
            if stop_string is not None:
                reason, stop_reason = "stop", stop_string
            elif seq.num_tokens - seq.num_pending >= seq.max_num_tokens:
                reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            seq.drop_pending()
            self.scheduler.finish(seq)

    def _request_output(self, request: _Request) -> RequestOutput:
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    logprobs=seq.logprobs,
                    stop_reason=seq.stop_reason,
                )
                for seq in request.seqs
            ],
            prompt_logprobs=first.prompt_logprobs,
            finished=True,
            spec_draft_tokens=sum(s.num_draft_tokens for s in request.seqs) if self.stats.speculative else None,
            spec_accepted_tokens=(
                sum(s.num_accepted_tokens for s in request.seqs) if self.stats.speculative else None
            ),
        )


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_tokens == 1 + len(item.draft) and item.start >= item.seq.num_prompt_tokens


def _logprob_dict(
    token: int,
    logprob: float,
    top_ids: list[list[int]] | None,
    top_values: list[list[float]] | None,
    row: int,
    num_top: int,
) -> dict[int, float]:
    """The row's `num_top` most likely tokens (the step computed the batch's largest count) plus `token`."""
    entries = dict(zip(top_ids[row][:num_top], top_values[row][:num_top])) if top_ids is not None else {}
    entries[token] = logprob
    return entries
