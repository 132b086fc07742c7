"""`POST /v1/chat/completions` (OpenAI Chat Completions, with DeepSeek's reasoning content)."""

from __future__ import annotations

import deepseek_recipe as recipe
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_core.server.recipe_api import RecipeAPI, handle

__all__ = ["CHAT_COMPLETIONS", "chat_completions"]

CHAT_COMPLETIONS = RecipeAPI(
    request_cls=recipe.ChatCompletionRequest,
    response_cls=recipe.ChatCompletionResponse,
    id_prefix="chatcmpl",
    max_tokens_field="max_tokens",
    has_n=True,
)


async def chat_completions(request: Request) -> Response:
    return await handle(request, CHAT_COMPLETIONS)
