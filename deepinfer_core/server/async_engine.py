"""An asyncio front end for the engine: one background thread runs the step loop while requests
arrive and leave; each request gets a queue of per-step updates.

Requests and aborts reach the engine thread through an inbox it drains before every step, so the
engine is only ever touched from that thread. After each step the thread publishes, for every
tracked request, the tokens and text its sequences gained; the event loop hands them to the HTTP
handler that awaits them. A stream that stops listening aborts its request, which frees its KV
blocks at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.grammar import PendingGrammar
from deepinfer_core.engine.outputs import Logprobs
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.server.metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "RequestUpdate", "SequenceDelta"]


class EngineDeadError(RuntimeError):
    """The engine thread failed a step; the request cannot finish."""


@dataclass(slots=True)
class SequenceDelta:
    """What one of a request's sequences produced since the previous update."""

    index: int
    token_ids: list[int]       # new output tokens; a terminating EOS / stop token id is left out
    text: str                  # new text; text that may still turn out to start a stop string waits
    logprobs: list[Logprobs] | None
    finish_reason: str | None  # "stop" | "length" once the sequence is done
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestUpdate:
    deltas: list[SequenceDelta]
    finished: bool
    error: Exception | None = None


@dataclass(slots=True, eq=False)
class _Tracked:
    seqs: list[Sequence]
    updates: asyncio.Queue[RequestUpdate]
    num_prompt_tokens: int
    sent_tokens: list[int] = field(init=False)  # per sequence: output tokens published so far
    sent_chars: list[int] = field(init=False)   # per sequence: characters of text published so far
    done: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.sent_tokens = [0] * len(self.seqs)
        self.sent_chars = [0] * len(self.seqs)
        self.done = [False] * len(self.seqs)


class RequestStream:
    """The updates of one request, in order; `abort()` (or leaving the `async for` early through
    `aclose()`) stops the request in the engine."""

    def __init__(self, engine: AsyncEngine, request_id: int, num_prompt_tokens: int,
                 updates: asyncio.Queue[RequestUpdate]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._updates = updates
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        try:
            while not self.finished:
                update = await self._updates.get()
                if update.error is not None:
                    self.finished = True
                    raise update.error
                self.finished = update.finished
                yield update
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._thread.join()
            self._thread = None

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  grammar: PendingGrammar | None = None) -> RequestStream:
        """Queue a request; raises what the engine's `add_request` raises for a request it refuses."""
        added: asyncio.Future[RequestStream] = self._loop.create_future()
        self._inbox.put(("add", prompt_token_ids, params, prompt, grammar, added))
        return await added

    def abort(self, request_id: int) -> None:
        self._inbox.put(("abort", request_id))

    # The engine thread.

    def _run(self) -> None:
        while True:
            if not self._drain_inbox(block=not self.engine.has_unfinished()):
                return
            if not self.engine.has_unfinished():
                continue
            started = time.perf_counter()
            try:
                self.engine.step()
            except Exception as error:  # noqa: BLE001 - every stream must hear about it
                self._fail_all(EngineDeadError(f"the engine failed a step: {error!r}"))
                continue
            self.metrics.observe_step(time.perf_counter() - started)
            self._publish()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                self._fail_all(EngineDeadError("the server is shutting down"))
                return False
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, token_ids: list[int], params: SamplingParams, prompt: str | None,
             grammar: PendingGrammar | None, added: asyncio.Future[RequestStream]) -> None:
        try:
            request_id = self.engine.add_request(token_ids, params, prompt, grammar)
        except Exception as error:  # noqa: BLE001 - handed to the caller, who answers 400
            self._loop.call_soon_threadsafe(_set_exception, added, error)
            return
        # NOTE: the engine keeps a request's sequences private; a new request's sequences wait in
        # the scheduler, the first carrying its siblings as forks where the prompt is prefilled once.
        seqs = [s for seq in self.engine.scheduler.waiting if seq.request_id == request_id for s in (seq, *seq.forks)]
        updates: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self._tracked[request_id] = _Tracked(sorted(seqs, key=lambda seq: seq.index), updates, len(token_ids))
        self.metrics.request_added(len(token_ids))
        stream = RequestStream(self, request_id, len(token_ids), updates)
        self._loop.call_soon_threadsafe(_hand_over, added, stream)

    def _abort(self, request_id: int) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.engine.abort(request_id)
            self.metrics.request_aborted()

    def _publish(self) -> None:
        for request_id, tracked in list(self._tracked.items()):
            deltas = [d for i, seq in enumerate(tracked.seqs) if (d := self._delta(tracked, i, seq))]
            finished = all(tracked.done)
            if finished:
                del self._tracked[request_id]
                self.metrics.request_finished([seq.finish_reason for seq in tracked.seqs])
            if deltas or finished:
                self.metrics.tokens_generated(sum(len(d.token_ids) for d in deltas))
                self._loop.call_soon_threadsafe(tracked.updates.put_nowait, RequestUpdate(deltas, finished))

    @staticmethod
    def _delta(tracked: _Tracked, index: int, seq: Sequence) -> SequenceDelta | None:
        if tracked.done[index]:
            return None
        finished = seq.finish_reason is not None
        known = seq.num_tokens - seq.num_pending - seq.num_prompt_tokens
        if finished and isinstance(seq.stop_reason, int):
            known -= 1  # the EOS / stop token ends the output; it is not part of it
        first = tracked.sent_tokens[index]
        text = seq.detokenizer.text
        end = len(text) if finished else len(text) - _stop_holdback(seq.params)
        start = tracked.sent_chars[index]
        if known <= first and end <= start and not finished:
            return None
        tracked.sent_tokens[index] = max(known, first)
        tracked.sent_chars[index] = max(end, start)
        tracked.done[index] = finished
        return SequenceDelta(
            index=seq.index,
            token_ids=seq.output_token_ids[first:known],
            text=text[start:end],
            logprobs=seq.logprobs[first:known] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _fail_all(self, error: Exception) -> None:
        for request_id, tracked in list(self._tracked.items()):
            if self.engine.has_unfinished():
                try:
                    self.engine.abort(request_id)
                except KeyError:
                    pass  # it finished in the failed step
            self._loop.call_soon_threadsafe(tracked.updates.put_nowait, RequestUpdate([], True, error))
        self._tracked.clear()


def _stop_holdback(params: SamplingParams) -> int:
    """Characters that could be the start of a stop string and so may still be cut."""
    return max((len(s) for s in params.stop), default=1) - 1


def _hand_over(future: asyncio.Future, stream: RequestStream) -> None:
    if future.done():  # the caller left (its client disconnected) while the request was queued
        stream.abort()
    else:
        future.set_result(stream)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
