"""The request path shared by the three APIs deepseek-recipe speaks (Chat Completions, Responses,
Anthropic Messages): recipe converts the request and renders the conversation, the engine
generates, and a recipe stream processor per sequence turns the tokens into the API's chunks
(reasoning content, DSML tool calls, stop sequences, usage).

DeepInfer adds what recipe lacks: `n` > 1 (one processor per sequence, chunk indices rewritten),
log-probabilities from the engine, `top_k` / `min_p`, and output constraints enforced by
structured output (`response_format` with a JSON schema, a regex, or any JSON object).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as recipe
from pydantic import ValidationError

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.outputs import Logprobs
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.structured import StructuredOutput
from deepinfer_core.server.async_engine import (
    EngineDeadError,
    RequestStream,
    SequenceDelta,
)
from deepinfer_core.server.limits import check_max_tokens, check_n, read_json_body
from deepinfer_core.server.protocol import APIError, error_body, sse_event
from deepinfer_core.server.state import ServerState
from deepinfer_core.server.tool_call_grammar import tool_call_ebnf

__all__ = ["RecipeAPI", "RecipeOutcome", "handle", "respond", "submit"]

_FINISH = {"stop": recipe.InferenceFinishReason.Stop, "length": recipe.InferenceFinishReason.Length}
# Sampling options that DeepInfer takes beyond what recipe converts; `n` only where the API has it.
_EXTRA_OPTIONS = ("top_k", "min_p")


@dataclass(frozen=True, slots=True)
class RecipeAPI:
    request_cls: Any        # recipe.ChatCompletionRequest | ResponsesRequest | MessagesRequest
    response_cls: Any       # recipe.ChatCompletionResponse | ResponsesResponse | MessagesResponse
    id_prefix: str
    max_tokens_field: str
    has_n: bool = False
    # Reads what the chunk generator needs from the request before conversion consumes it.
    generator_setup: Callable[[Any, recipe.ConversionOptions], Callable[[Any], Any]] | None = None


@dataclass(slots=True)
class RecipeOutcome:
    """A submitted request: stream its chunks with `sse()` or collect them with `json()`."""

    api: RecipeAPI
    stream: RequestStream
    processors: list[recipe.StreamProcessor]
    top_logprobs: int
    response_id: str
    model: str
    wants_stream: bool
    # NOTE: xgrammar never lets a grammar pick a special token, so a grammar-held tool call spells
    # DSML's special token out in ordinary tokens, which recipe's parser recognises in text only:
    # such outputs reach it as text (without log-probabilities).
    text_decoders: list[SpecialTextDecoder] | None = None

    async def _chunks(self) -> AsyncIterator[tuple[int, Any]]:
        try:
            for index, processor in enumerate(self.processors):
                ready = recipe.InferenceChunk.ready(
                    prompt_usage=recipe.PromptUsage(prompt_tokens=self.stream.num_prompt_tokens))
                for chunk in processor.push(ready):
                    yield index, chunk
            async for update in self.stream:
                for delta in update.deltas:
                    for chunk in self._feed(delta):
                        yield delta.index, chunk
                if all(p.finished for p in self.processors):
                    break  # a stop sequence ended every output; abort the rest (the finally below)
        finally:
            self.stream.abort()
            for processor in self.processors:
                if not processor.finished:
                    processor.close()

    def _feed(self, delta: SequenceDelta) -> list[Any]:
        processor = self.processors[delta.index]
        if processor.finished:
            return []
        chunks = []
        if delta.token_ids and self.text_decoders:
            text = self.text_decoders[delta.index].feed(delta.token_ids)
            chunks += processor.push(recipe.InferenceChunk.text(text, len(delta.token_ids)))
        elif delta.token_ids:
            chunks += processor.push(recipe.InferenceChunk.tokens(delta.token_ids, self._logprobs(delta)))
        if delta.finish_reason is not None and not processor.finished:
            chunks += processor.push(recipe.InferenceChunk.finish(_FINISH[delta.finish_reason]))
            chunks += processor.finish()
        return chunks

    def _logprobs(self, delta: SequenceDelta) -> list[tuple[float, list[tuple[int, float]]]] | None:
        if delta.logprobs is None:
            return None
        return [(entries[token], _top(entries, self.top_logprobs))
                for token, entries in zip(delta.token_ids, delta.logprobs)]

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async for index, chunk in self._chunks():
                data = chunk.to_json()
                if len(self.processors) > 1:
                    data = _with_choice_index(data, index)
                yield sse_event(data, self.api.response_cls.sse_event_name(chunk))
        except EngineDeadError as error:
            yield sse_event(error_body(str(error), "server_error"), "error")
            return
        done = self.api.response_cls.sse_done_data()
        if done is not None:
            yield sse_event(done)

    async def json(self) -> str:
        created = int(time.time())
        responses = [self.api.response_cls(self.response_id, self.model, created,
                                           self.stream.num_prompt_tokens, 0) for _ in self.processors]
        try:
            async for index, chunk in self._chunks():
                responses[index].accumulate(chunk)
        except EngineDeadError as error:
            raise APIError(500, str(error), error_type="server_error") from None
        if len(responses) == 1:
            return responses[0].to_json()
        return _merge_choices([json.loads(r.to_json()) for r in responses])


async def submit(state: ServerState, api: RecipeAPI, body: Any) -> RecipeOutcome:
    """Convert, render, validate and queue one request; every refusal is an `APIError`."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    extras = {key: body.pop(key) for key in _EXTRA_OPTIONS if key in body}
    n = body.pop("n", 1) if api.has_n else 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, f"n must be a positive integer, got {n!r}", param="n")
    check_n(state.limits, n)
    try:
        request = api.request_cls(body)
        setup = api.generator_setup(request, state.conversion) if api.generator_setup else None
        converted = request.convert(state.conversion)
    except recipe.ConversionError as error:
        raise APIError(error.status_code, str(error), body=error.body) from None
    except (ValueError, TypeError, OverflowError) as error:
        raise APIError(400, f"invalid request: {error}") from None

    try:
        token_ids = state.encoder.encode(converted.conversation)
    except (ValueError, RuntimeError) as error:
        raise APIError(400, f"the conversation cannot be rendered: {error}", param="messages") from None
    options = converted.inference_options
    if options.max_tokens is not None:
        check_max_tokens(state.limits, options.max_tokens, api.max_tokens_field)
    try:
        resolved = converted.resolve_max_tokens(len(token_ids), state.context_limit)
    except recipe.ConversionError as error:
        raise APIError(error.status_code, str(error), body=error.body) from None
    max_tokens = min(resolved, state.limits.max_tokens)
    state.check_prompt(token_ids, max_tokens)
    params = _sampling_params(options, n, extras, max_tokens)

    response_id = f"{api.id_prefix}-{uuid.uuid4().hex}"
    parsing = state.encoder.parsing_options(converted.parsing_options)
    processors = []
    for _ in range(n):
        generator = api.request_cls.chunk_generator(converted, response_id, state.model_name)
        if setup is not None:
            generator = setup(generator)
        processors.append(recipe.StreamProcessor(generator, parsing, state.encoder.recipe_tokenizer))
    grammar = await state.grammar_for(params)
    try:
        stream = await state.engine.add(token_ids, params, grammar=grammar)
    except ValueError as error:
        raise APIError(400, str(error)) from None
    spelled_out = options.output_constraint is not None and options.output_constraint.kind == "tool_call_required"
    decoders = [SpecialTextDecoder(state.llm.tokenizer) for _ in range(n)] if spelled_out else None
    return RecipeOutcome(api, stream, processors, params.logprobs or 0, response_id, state.model_name,
                         converted.stream, decoders)


def _sampling_params(options: Any, n: int, extras: dict[str, Any], max_tokens: int) -> SamplingParams:
    fields: dict[str, Any] = {
        "temperature": 1.0 if options.temperature is None else options.temperature,
        "top_p": 1.0 if options.top_p is None else options.top_p,
        "max_tokens": max_tokens,
        "n": n,
        "seed": options.seed,
        "logprobs": (options.top_logprobs or 0) if options.logprobs else None,
        **extras,
    }
    try:
        constraint = _structured_output(options.output_constraint)
        if constraint is not None:
            fields["structured_output"] = constraint
        return SamplingParams(**fields)
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(p) for p in problem["loc"])
        raise APIError(400, f"{field}: {problem['msg']}", param=field) from None
    except (ValueError, TypeError, KeyError, AttributeError) as error:  # a tool schema the grammar cannot follow
        raise APIError(400, f"the output constraint cannot be built: {error!r}", param="tools") from None


def _structured_output(constraint: Any) -> StructuredOutput | None:
    """recipe's output constraint as structured output. A required tool call is held to its tools'
    schemas; with tool_choice "auto" the answer may be free text, which no grammar here expresses."""
    if constraint is None:
        return None
    if constraint.kind == "tool_call_required":
        return StructuredOutput(ebnf=tool_call_ebnf(json.loads(constraint.schema)))
    if constraint.kind == "json":
        if not constraint.schema:
            return StructuredOutput(json_object=True)
        return StructuredOutput(json_schema=constraint.schema)
    if constraint.kind == "regex":
        return StructuredOutput(regex=constraint.schema)
    return None


def _top(entries: Logprobs, count: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda item: -item[1])[:count]


def _with_choice_index(data: str, index: int) -> str:
    chunk = json.loads(data)
    for choice in chunk.get("choices", []):
        choice["index"] = index
    return json.dumps(chunk, ensure_ascii=False)


def _merge_choices(responses: list[dict[str, Any]]) -> str:
    merged = dict(responses[0])
    merged["choices"] = [{**choice, "index": index}
                         for index, response in enumerate(responses) for choice in response["choices"]]
    completion_tokens = sum(response["usage"]["completion_tokens"] for response in responses)
    usage = merged["usage"]
    usage["completion_tokens"] = completion_tokens
    usage["total_tokens"] = usage["prompt_tokens"] + completion_tokens
    return json.dumps(merged, ensure_ascii=False)


async def respond(outcome: RecipeOutcome) -> Any:
    from starlette.responses import Response, StreamingResponse

    if outcome.wants_stream:
        return StreamingResponse(outcome.sse(), media_type="text/event-stream")
    return Response(await outcome.json(), media_type="application/json")


async def handle(request: Any, api: RecipeAPI) -> Any:
    """A route's whole work: read the body, submit, answer (streamed or whole)."""
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.limits)
    return await respond(await submit(state, api, body))


class SpecialTextDecoder(IncrementalDetokenizer):
    """Incremental text that keeps special tokens' spellings (recipe's parser needs to see them)."""

    __slots__ = ()

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [], [])

    def feed(self, token_ids: list[int]) -> str:
        """The text these tokens add (a character still incomplete waits for the next tokens)."""
        start = len(self.text)
        for token in token_ids:
            self.add_token(token)
        return self.text[start:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
