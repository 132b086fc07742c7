"""The FastAPI application: routes, API key, error bodies, and the engine thread's lifetime.

Every refusal is an `APIError` answered with its status and an error body the client can act on;
a request the server cannot read is a 4xx, never a 500, and never touches other requests.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from deepinfer_core.server.anthropic_messages import messages
from deepinfer_core.server.limits import check_api_key
from deepinfer_core.server.openai_chat import chat_completions
from deepinfer_core.server.openai_completions import completions
from deepinfer_core.server.openai_responses import responses
from deepinfer_core.server.protocol import APIError
from deepinfer_core.server.state import ServerState

__all__ = ["build_app"]


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)
    app.state.server = state

    @app.middleware("http")
    async def require_api_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1/"):
            try:
                check_api_key(state.limits, request.headers.get("authorization"), request.headers.get("x-api-key"))
            except APIError as error:
                return _error_response(request, error)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return _error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> Response:
        return _error_response(request, APIError(400, str(error)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return _error_response(request, APIError(error.status_code, str(error.detail)))

    for path, handler in (("/v1/chat/completions", chat_completions), ("/v1/completions", completions),
                          ("/v1/responses", responses), ("/v1/messages", messages)):
        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "deepinfer",
             "max_model_len": state.llm.max_model_len},
        ]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = state.metrics.render(state.llm.engine, state.engine.num_tracked)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _error_response(request: Request, error: APIError) -> Response:
    if error.status < 500:
        request.app.state.server.metrics.request_rejected(error.status)
    if request.url.path == "/v1/messages" and error.body is None:
        body = json.dumps({"type": "error", "error": {"type": error.error_type, "message": error.message}})
    else:
        body = error.to_json()
    return JSONResponse(json.loads(body), status_code=error.status)
