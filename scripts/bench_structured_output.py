"""Per-step cost of constrained decoding: the same batch unconstrained and under a JSON schema,
with asynchronous scheduling on and off.

    python scripts/bench_structured_output.py [--model_name ID_OR_PATH] [--batch 64] [--max_tokens 128]

Prints, per configuration, wall ms per step, the engine's host and device ms per step, and the
mean batch size (constrained requests may stop early, so compare per-step figures).
"""

from __future__ import annotations

import argparse
import time

from deepinfer_core import LLM, SamplingParams, StructuredOutput
from deepinfer_core.engine.engine import EngineStats

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "notes": {"type": "string"},
    },
    "required": ["title", "tags", "score", "notes"],
}


def run(model: str | None, batch: int, max_tokens: int, constrained: bool, async_scheduling: bool) -> dict[str, float]:
    llm = LLM(model=model, async_scheduling=async_scheduling, max_num_seqs=batch, seed=0)
    structured = StructuredOutput(json_schema=SCHEMA) if constrained else None
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=not constrained,
                            structured_output=structured)
    prompts = [f"Describe item {i} as JSON:" for i in range(batch)]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up: compile, first-touch allocations
    llm.engine.stats = EngineStats()
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    summary = llm.engine.stats.summary()
    return {
        "wall_ms_per_step": 1e3 * wall / max(summary["steps"], 1),
        "host_ms_per_step": summary["host_ms_per_step"],
        "device_ms_per_step": summary["device_ms_per_step"],
        "wait_ms_per_step": summary["wait_ms_per_step"],
        "mean_batch_size": summary["mean_batch_size"],
        "steps": summary["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max_tokens", type=int, default=128)
    args = parser.parse_args()
    print("constrained async | wall ms/step host ms/step device ms/step wait ms/step | batch steps")
    for constrained in (False, True):
        for async_scheduling in (True, False):
            r = run(args.model_name, args.batch, args.max_tokens, constrained, async_scheduling)
            print(f"{constrained!s:>11} {async_scheduling!s:>5} | {r['wall_ms_per_step']:12.2f} "
                  f"{r['host_ms_per_step']:12.2f} {r['device_ms_per_step']:14.2f} {r['wait_ms_per_step']:12.2f} "
                  f"| {r['mean_batch_size']:5.1f} {r['steps']:5d}")


if __name__ == "__main__":
    main()
