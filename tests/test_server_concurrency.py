"""Many streams at once: 64 concurrent greedy streams each equal the same request run alone, and a
client that leaves mid-stream has its request aborted and its KV blocks freed."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deepinfer_core.server.limits import ServerLimits
from tests.server_fixtures import GREEDY_CHAT, MODEL, metric, running_server

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")

NUM_STREAMS = 64
MAX_TOKENS = 8
LEAVING_MAX_TOKENS = 1000  # the leaving client's request, and the server's limit


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    limits = ServerLimits(max_tokens=LEAVING_MAX_TOKENS)
    with running_server(tiny_checkpoint, num_kv_blocks=512, max_num_seqs=NUM_STREAMS, limits=limits) as server:
        yield server


def _chat_body(index: int, stream: bool) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    content = f"{words[index % 8]} {index} " + "x" * (index % 5)
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "stream": stream, **GREEDY_CHAT}


async def _stream_text(http: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    pieces, finish = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    return "".join(pieces), finish


def test_concurrent_streams_equal_requests_run_alone(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        alone = []
        for index in range(NUM_STREAMS):
            answer = http.post("/v1/chat/completions", json=_chat_body(index, stream=False))
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            alone.append((choice["message"]["content"], choice["finish_reason"]))

    async def all_at_once() -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_stream_text(http, _chat_body(i, True)) for i in range(NUM_STREAMS)))

    together = asyncio.run(all_at_once())
    mismatched = [i for i in range(NUM_STREAMS) if together[i] != alone[i]]
    assert not mismatched, f"streams {mismatched} differ from the same request run alone"
    assert len({text for text, _ in alone}) > NUM_STREAMS // 2  # distinct prompts, distinct answers


def test_client_leaving_mid_stream_frees_its_blocks(server, monkeypatch):
    # EOS ignored, a long answer and each engine step slowed by 10 ms: the request is still running when the
    # client looks, however slowly a loaded machine lets it read (a 64-token answer, and once on a loaded CI
    # machine a 1,000-token one at full speed, finished before the client looked and held no blocks)
    engine = server.state.engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.01), step())[1])
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        before = http.get("/metrics").text
        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": LEAVING_MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            held = metric(http.get("/metrics").text, "deepinfer_kv_blocks_used")
        assert held > 0  # the request still held blocks while the client listened
        deadline = time.monotonic() + 20
        while True:
            after = http.get("/metrics").text
            freed = metric(after, "deepinfer_kv_blocks_used") == 0 and metric(after, "deepinfer_requests_running") == 0
            if freed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert freed, "the abandoned request kept its KV blocks"
        aborted = metric(after, "deepinfer_requests_aborted_total") - metric(before, "deepinfer_requests_aborted_total")
        assert aborted == 1
        generated = (metric(after, "deepinfer_generation_tokens_total")
                     - metric(before, "deepinfer_generation_tokens_total"))
        assert generated < LEAVING_MAX_TOKENS  # it stopped early instead of running to max_tokens
