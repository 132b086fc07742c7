"""Hostile and malformed requests get 4xx answers with messages, never a 500 or a crash, and a
well-formed stream running meanwhile is unaffected."""

from __future__ import annotations

import json
import threading

import pytest

from tests.server_fixtures import GREEDY_CHAT, MODEL, metric, running_server

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")

MESSAGES = [{"role": "user", "content": "hello"}]
BASES = {
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hello", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
}
HUGE = [10**30, -1, 2**64, 1e308, float("-inf")]
WRONG_TYPES = ["four", [1], {"a": 1}, True, None]
# Per API, fields and values that no server should accept.
BAD_FIELDS = {
    "/v1/chat/completions": {
        "model": ["nope", 7, None, ""],
        "messages": [[], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": 5}], [1, 2], [{"role": "tool", "content": "x"}]],
        "max_tokens": [0, *HUGE, "4", 4.5],
        "temperature": [-1, 3, *WRONG_TYPES[:3], 1e308],
        "top_p": [-0.5, 1.5, "x"],
        "n": [0, -3, 10**9, "2", 1.5],
        "seed": [-1, 2**64, "s"],
        "top_logprobs": [-1, 100, "x"],
        "logprobs": ["yes", 3],
        "stop": [5, [1, 2], {"a": "b"}],
        "stream": ["maybe", 2],
        "response_format": [{"type": "bogus"}, "json", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}},
                            {"type": "json_schema"}],
        "tools": ["x", [{"type": "function"}], [{"type": "function", "function": {"name": 3}}],
                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]],
        "tool_choice": ["sometimes", 3],
        "top_k": [-1, "x", 1.5],
        "min_p": [-0.1, 2, "x"],
    },
    "/v1/completions": {
        "model": ["nope", 7, None],
        "prompt": ["", [], [-1], [10**9], [1.5], {"a": 1}, None, [["nested"]]],
        "max_tokens": [0, *HUGE, "4"],
        "temperature": [-1, 3, "hot"],
        "top_p": [0, 1.5],
        "n": [0, 10**9, "2"],
        "seed": [-1, 2**64],
        "logprobs": [-1, 100, "x"],
        "stop": [5, [""], [1]],
        "stop_token_ids": [[-1], "x", [10**9]],
        "echo": [True],
        "best_of": [3],
        "frequency_penalty": [0.5],
        "unknown_field": [1, "x"],
    },
    "/v1/responses": {
        "model": ["nope", None],
        "input": [5, None, [{"role": "wizard", "content": "x"}], [{"type": "bogus"}]],
        "max_output_tokens": [0, *HUGE, "4"],
        "temperature": [-1, 3, "x"],
        "top_p": [-1, 2],
        "text": [{"format": {"type": "bogus"}}, "x"],
        "tools": ["x", [{"type": "function"}]],
    },
    "/v1/messages": {
        "model": ["nope", None],
        "messages": [[], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}]],
        "max_tokens": [0, -1, "4", 10**30],
        "temperature": [-1, 3, "x"],
        "top_p": [-1, 2],
        "stop_sequences": [5, "x"],
        "tools": ["x", [{"name": 3}]],
    },
}
RAW_BODIES = [b"", b"{", b"not json", b"\xff\xfe\x00garbage", b"[]", b"null", b"42", b'"text"', b"{}",
              b'{"model": "tiny"', b"{" * 10000 + b"}" * 10000, json.dumps([BASES]).encode(),
              b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}']


def hostile_requests() -> list[tuple[str, bytes | dict]]:
    cases: list[tuple[str, bytes | dict]] = []
    for path, fields in BAD_FIELDS.items():
        for field, values in fields.items():
            cases += [(path, {**BASES[path], field: value}) for value in values]
        cases += [(path, raw) for raw in RAW_BODIES]
        cases.append((path, {k: v for k, v in BASES[path].items() if k != "model"}))
    long_text = "word " * 20000  # over-long: more tokens than this server's KV cache holds
    cases += [
        ("/v1/completions", {**BASES["/v1/completions"], "prompt": long_text}),
        ("/v1/completions", {**BASES["/v1/completions"], "prompt": list(range(300)) * 40}),
        ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "messages": [{"role": "user", "content": long_text}]}),
        ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "messages": [{"role": "user", "content": "x" * 200_000}]}),
        ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "response_format": {"type": "regex", "regex": "([a-z"}}),
        ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "response_format": {"type": "regex", "regex": 5}}),
    ]
    return cases


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint, num_kv_blocks=128, max_num_seqs=16) as server:
        yield server


def _stream_text(base_url: str, body: dict) -> str:
    pieces = []
    with (httpx.Client(base_url=base_url, timeout=300) as http,
          http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(pieces)


def test_hostile_requests_get_4xx_and_leave_streams_alone(server):
    cases = hostile_requests()
    assert len(cases) >= 200
    good = {"model": MODEL, "messages": [{"role": "user", "content": "steady"}], "max_tokens": 48, **GREEDY_CHAT}
    alone = _stream_text(server.base_url, good)
    fuzzing = threading.Event()
    fuzzing.set()
    streamed: list[str] = []

    def stream_while_fuzzing() -> None:  # well-formed streams, back to back, for as long as the fuzz runs
        while fuzzing.is_set() and len(streamed) < 100:
            streamed.append(_stream_text(server.base_url, good))

    runner = threading.Thread(target=stream_while_fuzzing)
    runner.start()
    failures = []
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            for path, body in cases:
                if isinstance(body, bytes):
                    answer = http.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    answer = http.post(path, content=json.dumps(body, allow_nan=True))
                if not 400 <= answer.status_code < 500:
                    failures.append((path, str(body)[:200], answer.status_code, answer.text[:200]))
                elif answer.status_code != 413:
                    assert "message" in answer.text, answer.text  # the client is told what is wrong
            assert http.post("/v1/nowhere", json={}).status_code == 404
            assert http.get("/v1/chat/completions").status_code == 405
    finally:
        fuzzing.clear()
        runner.join(timeout=300)
    assert not failures, f"{len(failures)} of {len(cases)} hostile requests were not refused: {failures[:10]}"
    assert streamed and all(text == alone for text in streamed)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        text = http.get("/metrics").text
    assert metric(text, "deepinfer_kv_blocks_used") == 0
    assert metric(text, "deepinfer_requests_running") == 0
