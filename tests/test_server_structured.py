"""Output constraints through the server: `response_format` with a JSON schema or a regex gives
content that validates (the tiny checkpoint's unconstrained output is noise, so this is a strong
test), and a bad schema or regex is a 400."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer_core.server.limits import ServerLimits
from tests.server_fixtures import GREEDY_CHAT, MODEL, running_server

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")
jsonschema = pytest.importorskip("jsonschema", reason="schemas are checked with the jsonschema library")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def http(tiny_checkpoint):
    # Room for a random model's JSON: only the grammar's bounds end it.
    with (running_server(tiny_checkpoint, num_kv_blocks=128, max_num_seqs=8, limits=ServerLimits(max_tokens=256)) as server,
          httpx.Client(base_url=server.base_url, timeout=300) as http):
        yield http


def _content(http, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "answer in json"}], "max_tokens": 256,
            **GREEDY_CHAT, **fields}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


@pytest.mark.parametrize("temperature", [0, 1])
def test_json_schema_response_format_validates(http, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    choice = _content(http, response_format=fmt, temperature=temperature, seed=3)
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_regex_response_format_full_matches(http):
    choice = _content(http, response_format={"type": "regex", "regex": "[a-z]{3,6}-[0-9]{2}"})
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", choice["message"]["content"])


def test_bad_regex_is_a_400(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "regex", "regex": "([a-z"}, **GREEDY_CHAT}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and "regex" in answer.text
