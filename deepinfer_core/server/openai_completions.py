"""`POST /v1/completions` (OpenAI legacy Completions): raw text in, the engine's text out; stop
strings, `n`, seeds and log-probabilities are the engine's own."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.server.async_engine import (
    EngineDeadError,
    RequestStream,
    SequenceDelta,
)
from deepinfer_core.server.limits import check_max_tokens, check_n, read_json_body
from deepinfer_core.server.protocol import (
    APIError,
    CompletionRequest,
    error_body,
    sse_event,
)
from deepinfer_core.server.state import ServerState

__all__ = ["completions"]


async def completions(request: Request) -> Response:
    from starlette.responses import Response, StreamingResponse

    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.limits)
    parsed = _parse(body)
    if parsed.model != state.model_name:
        raise APIError(404, f"model {parsed.model!r} is not served here; this server serves "
                       f"{state.model_name!r}", param="model", error_type="model_not_found")
    check_max_tokens(state.limits, parsed.max_tokens)
    check_n(state.limits, parsed.n)
    if isinstance(parsed.prompt, str):
        if state.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        token_ids = list(state.llm.tokenizer.encode(parsed.prompt))
    else:
        token_ids = parsed.prompt
    state.check_prompt(token_ids, parsed.max_tokens)
    vocab = state.llm.model_config.vocab_size
    if any(t >= vocab for t in parsed.stop_token_ids or []):
        raise APIError(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
    try:
        params = SamplingParams(
            temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k, min_p=parsed.min_p,
            max_tokens=parsed.max_tokens, stop=parsed.stop or [], stop_token_ids=parsed.stop_token_ids or [],
            ignore_eos=parsed.ignore_eos, n=parsed.n, seed=parsed.seed, logprobs=parsed.logprobs,
        )
        stream = await state.engine.add(token_ids, params)
    except ValueError as error:  # pydantic's ValidationError is one
        raise APIError(400, str(error)) from None
    answer = _Answer(state, stream, f"cmpl-{uuid.uuid4().hex}", int(time.time()), parsed)
    if parsed.stream:
        return StreamingResponse(answer.sse(), media_type="text/event-stream")
    return Response(await answer.json(), media_type="application/json")


def _parse(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(p) for p in problem["loc"])
        raise APIError(400, f"{field}: {problem['msg']}", param=field) from None


class _Answer:
    def __init__(self, state: ServerState, stream: RequestStream, completion_id: str, created: int,
                 request: CompletionRequest) -> None:
        self.tokenizer = state.llm.tokenizer
        self.stream = stream
        self.head = {"id": completion_id, "object": "text_completion", "created": created,
                     "model": request.model}
        self.request = request
        self.num_output_tokens = 0

    def _choice(self, delta: SequenceDelta) -> dict[str, Any]:
        self.num_output_tokens += len(delta.token_ids) + (isinstance(delta.stop_reason, int))
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}

    def _logprobs(self, delta: SequenceDelta) -> dict[str, Any] | None:
        if delta.logprobs is None:
            return None
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else str
        return {
            "tokens": [decode(t) for t in delta.token_ids],
            "token_logprobs": [entries[t] for t, entries in zip(delta.token_ids, delta.logprobs)],
            "top_logprobs": [
                {decode(t): lp for t, lp in sorted(entries.items(), key=lambda e: -e[1])[:self.request.logprobs]}
                for entries in delta.logprobs
            ],
        }

    def _usage(self) -> dict[str, int]:
        prompt = self.stream.num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                "total_tokens": prompt + self.num_output_tokens}

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async for update in self.stream:
                if update.deltas:
                    choices = [self._choice(d) for d in update.deltas]
                    yield sse_event(json.dumps({**self.head, "choices": choices}, ensure_ascii=False))
        except EngineDeadError as error:
            yield sse_event(error_body(str(error), "server_error"), "error")
            return
        finally:
            self.stream.abort()
        options = self.request.stream_options
        if options is not None and options.include_usage:
            yield sse_event(json.dumps({**self.head, "choices": [], "usage": self._usage()}))
        yield sse_event("[DONE]")

    async def json(self) -> str:
        choices: dict[int, dict[str, Any]] = {}
        try:
            async for update in self.stream:
                for delta in update.deltas:
                    piece = self._choice(delta)
                    if delta.index not in choices:
                        choices[delta.index] = piece
                        continue
                    choice = choices[delta.index]
                    choice["text"] += piece["text"]
                    choice["finish_reason"], choice["stop_reason"] = piece["finish_reason"], piece["stop_reason"]
                    if piece["logprobs"] is not None:
                        for key, values in piece["logprobs"].items():
                            choice["logprobs"][key] += values
        except EngineDeadError as error:
            raise APIError(500, str(error), error_type="server_error") from None
        finally:
            self.stream.abort()
        ordered = [choices[i] for i in sorted(choices)]
        return json.dumps({**self.head, "choices": ordered, "usage": self._usage()}, ensure_ascii=False)
