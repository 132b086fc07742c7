"""What the HTTP layer needs beyond deepseek-recipe: error bodies, server-sent events, and the
legacy `/v1/completions` request (deepseek-recipe converts only chat-style APIs)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["APIError", "CompletionRequest", "error_body", "sse_event"]


class APIError(Exception):
    """An error the client gets as an OpenAI-style error body with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 error_type: str = "invalid_request_error", body: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.body = body  # a ready error body (deepseek-recipe writes its own)

    def to_json(self) -> str:
        return self.body or error_body(self.message, self.error_type, self.param)


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": error_type}})


def sse_event(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: one prompt (text or token ids) per request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[int] = Field(description="Text, or token ids.")
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: Literal[False] = False
    # NOTE: the official client sends these with their neutral values; anything else is refused.
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0
    best_of: Literal[1] | None = None
