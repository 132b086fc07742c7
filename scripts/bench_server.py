"""A short load test of the HTTP server: requests/s and time-to-first-token percentiles.

    python scripts/bench_server.py [--model PATH] [--requests 64] [--concurrency 16] [--max-tokens 16]
    python scripts/bench_server.py --base-url http://127.0.0.1:8000 --model-name NAME

Without --base-url it serves --model (default: a tiny random checkpoint in a temporary directory)
on a free loopback port for the run. Loopback only; bounded by --requests and --time-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from urllib.parse import urlparse

import httpx

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


async def one_request(http: httpx.AsyncClient, body: dict) -> tuple[float, float, int]:
    """(time to first token, total time, chunks with text) of one streamed chat completion."""
    started = time.perf_counter()
    first, pieces = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if any(c["delta"].get("content") or c["delta"].get("reasoning_content") for c in choices):
                pieces += 1
                first = first if first is not None else time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started, pieces


async def load(base_url: str, model: str, args: argparse.Namespace) -> list[tuple[float, float, int]]:
    limit = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.time_limit

    async def bounded(index: int) -> tuple[float, float, int] | None:
        async with limit:
            if time.monotonic() > deadline:
                return None
            body = {"model": model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                    "thinking": {"type": "disabled"},
                    "messages": [{"role": "user", "content": f"request {index}: tell me something"}]}
            return await one_request(http, body)

    async with httpx.AsyncClient(base_url=base_url, timeout=args.time_limit,
                                 limits=httpx.Limits(max_connections=args.concurrency)) as http:
        results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
    return [r for r in results if r is not None]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server on this machine (default: start one)")
    parser.add_argument("--model-name", default="deepinfer", help="the served model name")
    parser.add_argument("--model", help="checkpoint to serve when no --base-url (default: tiny random)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds; later requests are skipped")
    args = parser.parse_args()

    with ExitStack() as stack:
        if args.base_url:
            if urlparse(args.base_url).hostname not in _LOOPBACK:
                parser.error("--base-url must be a loopback address: this load test stays on this machine")
            base_url = args.base_url
        else:
            from deepinfer_core import LLM
            from deepinfer_core.server.serve import BackgroundServer

            model = args.model
            if model is None:
                from deepinfer_core.tools import make_tiny_checkpoint

                model = str(make_tiny_checkpoint(stack.enter_context(tempfile.TemporaryDirectory()) + "/tiny"))
            llm = LLM(model, max_num_seqs=max(args.concurrency, 1))
            base_url = stack.enter_context(BackgroundServer(llm, model_name=args.model_name)).base_url
        started = time.perf_counter()
        results = asyncio.run(load(base_url, args.model_name, args))
        wall = time.perf_counter() - started

    ttft = [r[0] * 1e3 for r in results if r[0] == r[0]]
    print(f"requests: {len(results)} of {args.requests} in {wall:.2f} s, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}")
    print(f"requests/s: {len(results) / wall:.2f}")
    print(f"streamed chunks/s: {sum(r[2] for r in results) / wall:.1f}")
    if ttft:
        print(f"TTFT ms: p50 {percentile(ttft, 50):.1f}  p90 {percentile(ttft, 90):.1f}  "
              f"p99 {percentile(ttft, 99):.1f}  mean {statistics.fmean(ttft):.1f}")
    print(f"latency s: p50 {percentile([r[1] for r in results], 50):.2f}  "
          f"p99 {percentile([r[1] for r in results], 99):.2f}")


if __name__ == "__main__":
    main()
