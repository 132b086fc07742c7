"""The four APIs on the tiny checkpoint through the official `openai` client and raw HTTP:
non-streaming and streaming answers agree, usage adds up, health / models / metrics answer."""

from __future__ import annotations

import json

import pytest

from tests.server_fixtures import GREEDY_CHAT, MODEL, metric, running_server

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")

openai = pytest.importorskip("openai", reason="the server tests drive the official openai client")

CHAT = [{"role": "user", "content": "def parse(text):"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


def test_health_models_metrics(http, client):
    assert http.get("/health").status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]
    text = http.get("/metrics").text
    for name in ("deepinfer_requests_total", "deepinfer_generation_tokens_total", "deepinfer_queue_depth",
                 "deepinfer_step_seconds", "deepinfer_kv_blocks_used", "deepinfer_kv_cache_usage_ratio"):
        assert f"# TYPE {name} " in text


def test_chat_stream_equals_whole_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, extra_body=GREEDY_CHAT)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.content
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True,
                                            extra_body=GREEDY_CHAT)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_stop_sequence_cuts_the_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, extra_body=GREEDY_CHAT)
    text = whole.choices[0].message.content
    stop = text[3:5] if len(text) >= 5 and text[3:5].strip() else None
    if stop is None:
        pytest.skip(f"the greedy answer {text!r} has no usable stop string")
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, stop=[stop],
                                         extra_body=GREEDY_CHAT)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.find(stop)]


def test_chat_n_logprobs_and_seed(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7, temperature=0.9, logprobs=True, top_logprobs=2,
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    for choice in answer.choices:
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 2
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # the top one is the most likely
    again = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7, temperature=0.9,
        extra_body={"thinking": {"type": "disabled"}},
    )
    texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]


def test_completions_stream_equals_whole_answer_and_stops(client):
    whole = client.completions.create(model=MODEL, prompt="import json\n", max_tokens=10, temperature=0,
                                      logprobs=2)
    choice = whole.choices[0]
    assert len(choice.logprobs.token_logprobs) == whole.usage.completion_tokens
    streamed = client.completions.create(model=MODEL, prompt="import json\n", max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    if len(choice.text) > 3:
        stop = choice.text[2:4]
        cut = client.completions.create(model=MODEL, prompt="import json\n", max_tokens=10, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == choice.text[:choice.text.find(stop)]


def test_responses_whole_and_streamed(client):
    whole = client.responses.create(model=MODEL, input="hello", max_output_tokens=8, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens > 0
    with client.responses.stream(model=MODEL, input="hello", max_output_tokens=8, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text


def test_messages_whole_and_streamed(http):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    whole = http.post("/v1/messages", json=body)
    assert whole.status_code == 200, whole.text
    message = whole.json()
    assert message["type"] == "message" and message["stop_reason"] in ("max_tokens", "end_turn")
    text = "".join(block["text"] for block in message["content"] if block["type"] == "text")
    events, pieces = [], []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "content_block_delta":
                    pieces.append(data["delta"]["text"])
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "".join(pieces) == text


def test_metrics_count_the_traffic(http):
    before = http.get("/metrics").text
    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 5,
                                                "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    after = http.get("/metrics").text
    assert metric(after, "deepinfer_requests_total") - metric(before, "deepinfer_requests_total") == 1
    generated = metric(after, "deepinfer_generation_tokens_total") - metric(before, "deepinfer_generation_tokens_total")
    assert generated == 5
    assert metric(after, "deepinfer_kv_blocks_used") == 0  # the request finished and gave its blocks back


def test_api_key_is_required_when_set(tiny_checkpoint):
    from deepinfer_core.server.limits import ServerLimits

    with (running_server(tiny_checkpoint, num_kv_blocks=16, max_num_seqs=4,
                         limits=ServerLimits(api_key="secret")) as server,
          httpx.Client(base_url=server.base_url, timeout=60) as http):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        wrong = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
        assert right.status_code == 200, right.text
        assert http.get("/health").status_code == 200
