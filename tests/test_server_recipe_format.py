"""A checkpoint without a chat template is served in DeepSeek's own format through deepseek-recipe:
thinking mode yields reasoning content, and a required tool call, held to its schema by structured
output, parses into arguments that validate with no DSML left in the answer."""

from __future__ import annotations

import json

import pytest

from deepinfer_core.server.limits import ServerLimits
from tests.server_fixtures import MODEL, make_recipe_checkpoint, running_server

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")
jsonschema = pytest.importorskip("jsonschema", reason="arguments are checked with the jsonschema library")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_recipe_checkpoint(tmp_path_factory.mktemp("recipe") / "tiny-v4-recipe")
    # A random model closes a tool-call block only when the grammar's call limit makes it: room for that.
    with running_server(checkpoint, num_kv_blocks=256, max_num_seqs=8, limits=ServerLimits(max_tokens=640)) as server:
        assert not server.state.encoder.uses_chat_template
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        yield http


def test_thinking_mode_answers_with_reasoning_content(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "think first"}], "max_tokens": 10, "seed": 1}
    whole = http.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"]  # the prompt opened <think>: what follows is reasoning
    pieces = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["delta"].get("reasoning_content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == message["reasoning_content"]


def test_messages_api_in_thinking_mode_has_a_thinking_block(http):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    answer = http.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["type"] == "thinking"


def test_required_tool_call_parses_into_arguments_that_validate(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 640,
            "tools": TOOLS, "tool_choice": "required", "thinking": {"type": "disabled"},
            "temperature": 1.0, "seed": 5}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert "DSML" not in (choice["message"]["content"] or "")
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
