"""Server counters and gauges in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """Counts what the engine thread and the HTTP handlers report; `render` reads the engine's
    queue depth and KV pool when scraped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_added = 0
        self.requests_aborted = 0
        self.finish_reasons: Counter[str] = Counter()
        self.rejected: Counter[int] = Counter()  # HTTP status -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0

    def request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.requests_added += 1
            self.prompt_tokens += num_prompt_tokens

    def request_aborted(self) -> None:
        with self._lock:
            self.requests_aborted += 1

    def request_finished(self, reasons: list[str | None]) -> None:
        with self._lock:
            self.finish_reasons.update(r for r in reasons if r is not None)

    def request_rejected(self, status: int) -> None:
        with self._lock:
            self.rejected[status] += 1

    def tokens_generated(self, count: int) -> None:
        with self._lock:
            self.generation_tokens += count

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds

    def render(self, engine: Any, running_requests: int) -> str:
        kv = engine.scheduler.kv
        used = kv.num_blocks - kv.num_free_blocks
        with self._lock:
            lines = [
                *_metric("deepinfer_requests_total", "counter", "Requests the engine accepted.",
                         [("", self.requests_added)]),
                *_metric("deepinfer_requests_finished_total", "counter", "Sequences finished, by reason.",
                         [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finish_reasons.items())]),
                *_metric("deepinfer_requests_aborted_total", "counter",
                         "Requests aborted (client gone or output parser done).", [("", self.requests_aborted)]),
                *_metric("deepinfer_requests_rejected_total", "counter", "Requests refused, by HTTP status.",
                         [(f'{{status="{s}"}}', n) for s, n in sorted(self.rejected.items())]),
                *_metric("deepinfer_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                         [("", self.prompt_tokens)]),
                *_metric("deepinfer_generation_tokens_total", "counter", "Output tokens streamed.",
                         [("", self.generation_tokens)]),
                *_metric("deepinfer_requests_running", "gauge", "Requests in the engine.",
                         [("", running_requests)]),
                *_metric("deepinfer_queue_depth", "gauge", "Sequences waiting to be scheduled.",
                         [("", len(engine.scheduler.waiting))]),
                *_metric("deepinfer_step_seconds", "summary", "Wall time of engine steps.",
                         [("_sum", self.step_seconds), ("_count", self.steps)]),
                *_metric("deepinfer_kv_blocks_used", "gauge", "KV cache blocks held by sequences.",
                         [("", used)]),
                *_metric("deepinfer_kv_blocks_total", "gauge", "KV cache blocks in the pool.",
                         [("", kv.num_blocks)]),
                *_metric("deepinfer_kv_cache_usage_ratio", "gauge", "Share of KV cache blocks in use.",
                         [("", used / kv.num_blocks if kv.num_blocks else 0.0)]),
            ]
            spec = engine.stats.speculative
            if spec is not None:
                lines += [
                    *_metric("deepinfer_spec_draft_tokens_total", "counter", "Draft tokens verified.",
                             [("", spec.num_drafted)]),
                    *_metric("deepinfer_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
                             [("", spec.num_accepted)]),
                    *_metric("deepinfer_spec_acceptance_rate", "gauge", "Accepted / verified draft tokens.",
                             [("", spec.acceptance_rate)]),
                ]
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    # A suffix is a label set (`{reason="stop"}`) or a summary's `_sum` / `_count`.
    lines += [f"{name}{suffix} {value}" for suffix, value in samples]
    return lines
