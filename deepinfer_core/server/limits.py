"""What one request may ask for, and who may ask: the server's request limits and API key."""

from __future__ import annotations

import hmac
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer_core.server.protocol import APIError

__all__ = ["ServerLimits", "check_api_key", "check_max_tokens", "check_n", "read_json_body"]


class ServerLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: str | None = Field(None, description="Bearer token (or x-api-key) every /v1 call must send.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body.")
    max_tokens: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(16, ge=1, description="Largest n (completions per request).")


def check_api_key(limits: ServerLimits, authorization: str | None, x_api_key: str | None) -> None:
    if limits.api_key is None:
        return
    offered = x_api_key or ""
    if authorization and authorization.lower().startswith("bearer "):
        offered = authorization[7:].strip()
    if not hmac.compare_digest(offered.encode(), limits.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                       error_type="authentication_error")


def check_max_tokens(limits: ServerLimits, requested: int, field: str = "max_tokens") -> None:
    if requested > limits.max_tokens:
        raise APIError(400, f"{field}={requested} exceeds this server's limit of {limits.max_tokens}; "
                       "ask for fewer tokens", param=field)


def check_n(limits: ServerLimits, n: int) -> None:
    if n > limits.max_n:
        raise APIError(400, f"n={n} exceeds this server's limit of {limits.max_n}", param="n")


async def read_json_body(request: Any, limits: ServerLimits) -> Any:
    """The request's JSON body, refused with 413 past `max_request_bytes` (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise APIError(413, f"the request body has {declared} bytes; this server accepts at most "
                       f"{limits.max_request_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limits.max_request_bytes:
            raise APIError(413, f"the request body exceeds this server's limit of {limits.max_request_bytes} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
