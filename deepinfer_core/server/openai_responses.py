"""`POST /v1/responses` (OpenAI Responses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import deepseek_recipe as recipe
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_core.server.recipe_api import RecipeAPI, handle

__all__ = ["RESPONSES", "responses"]


def _echo_and_namespaces(request: Any, options: recipe.ConversionOptions) -> Callable[[Any], Any]:
    echo = request.echo()
    namespaces = request.namespace_tool_map(options)
    return lambda generator: generator.with_namespace_tool_map(namespaces).with_echo(echo)


RESPONSES = RecipeAPI(
    request_cls=recipe.ResponsesRequest,
    response_cls=recipe.ResponsesResponse,
    id_prefix="resp",
    max_tokens_field="max_output_tokens",
    generator_setup=_echo_and_namespaces,
)


async def responses(request: Request) -> Response:
    return await handle(request, RESPONSES)
