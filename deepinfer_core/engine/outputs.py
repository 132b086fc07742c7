"""What `LLM.generate` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CompletionOutput", "RequestOutput", "Logprobs"]

# token id -> log-probability under the model's raw (untempered, unfiltered) distribution
Logprobs = dict[int, float]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"] | None
    logprobs: list[Logprobs] | None = None  # one dict per generated token: top-k plus the sampled one
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # one per prompt position, the first None
    finished: bool = False
    # Speculative decoding (None when off), summed over the request's completions: drafts the
    # target verified, and those it accepted that became output tokens.
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
