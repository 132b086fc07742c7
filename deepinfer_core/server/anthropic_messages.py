"""`POST /v1/messages` (Anthropic Messages)."""

from __future__ import annotations

import deepseek_recipe as recipe
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_core.server.recipe_api import RecipeAPI, handle

__all__ = ["MESSAGES", "messages"]

MESSAGES = RecipeAPI(
    request_cls=recipe.MessagesRequest,
    response_cls=recipe.MessagesResponse,
    id_prefix="msg",
    max_tokens_field="max_tokens",
)


async def messages(request: Request) -> Response:
    return await handle(request, MESSAGES)
