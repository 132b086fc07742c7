"""Generate completions for a batch of prompts and print what the engine did.

    python examples/offline_inference.py [--model_name ID_OR_PATH] [--max_tokens N] [--temperature T]
                                         [--speculative-k K [--speculative-threshold T | --speculative-survival P]]
                                         [--ep N] [--dp N] [--num-redundant-experts N] [--eplb-interval N]

The model is `--model_name`, else DEEPINFER_HF_MODEL_DIR, else (on a machine whose backend is the
`cpu` one) a tiny random checkpoint written on first use to ~/.cache/deepinfer/tiny-deepseek-v4,
else the default hub checkpoint (DeepSeek-V4.1-Flash-1017). DEEPINFER_ACCELERATOR picks the backend.
`--speculative-k K` drafts with the checkpoint's own drafter (MTP for V4, DSpark for V4.1). `--ep N` / `--dp N` serve it
from several processes (expert / attention data parallelism), spawned here, one per rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer_core import LLM, SamplingParams, SpeculativeConfig, envs
from deepinfer_core.model_config import load_model_config
from deepinfer_core.weights.resolve import resolve_model_path
from deepinfer_core.platform.registry import select_backend

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "The future of AI is",
    "import json\n\n",
    "Once upon a time, there was",
    "The three laws of thermodynamics are",
    "for i in range(10):",
]
TINY_CHECKPOINT = Path.home() / ".cache" / "deepinfer" / "tiny-deepseek-v4"


def pick_model(model_name: str | None, accelerator: str | None) -> str | None:
    """An explicit name, else the environment's directory, else the tiny checkpoint off-GPU."""
    if model_name or envs.hf_model_dir() is not None:
        return model_name
    if select_backend(accelerator).device_type != "cpu":
        return None
    if not (TINY_CHECKPOINT / "config.json").is_file():
        from deepinfer_core.tools.tiny_checkpoint import make_tiny_checkpoint

        print(f"writing the tiny random checkpoint to {TINY_CHECKPOINT} (first run only)")
        make_tiny_checkpoint(TINY_CHECKPOINT)
    return str(TINY_CHECKPOINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default=None, help="checkpoint directory or hub id")
    parser.add_argument("--accelerator", default=None, help="backend name (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num_prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max_model_len", type=int, default=4096)
    parser.add_argument("--no_async", action="store_true", help="turn asynchronous scheduling off")
    parser.add_argument("--enforce-eager", action="store_true", help="launch decode steps op by op (no device graphs)")
    parser.add_argument("--speculative-k", type=int, default=0,
                        help="draft up to K tokens per step with the checkpoint's MTP layer (0 = off)")
    parser.add_argument("--speculative-threshold", type=float, default=0.0,
                        help="MTP: stop drafting once a draft's own probability falls below this")
    parser.add_argument("--speculative-survival", type=float, default=0.0,
                        help="DSpark: verify drafts while their prefix survival probability stays above this")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism: ranks the experts are spread over")
    parser.add_argument("--dp", type=int, default=1, help="attention data parallelism: ranks the requests are split over")
    parser.add_argument("--num-redundant-experts", type=int, default=0, help="extra expert slots per EP group (EPLB)")
    parser.add_argument("--eplb-interval", type=int, default=None, help="re-place experts every N steps (EPLB)")
    args = parser.parse_args()
    model = pick_model(args.model_name, args.accelerator)
    speculative = None
    if args.speculative_k:
        # the checkpoint's own drafter: V4's MTP layer, V4.1's DSpark stages
        if load_model_config(resolve_model_path(model)).model_type.startswith("deepseek_v41"):
            speculative = SpeculativeConfig(method="dspark", num_draft_tokens=args.speculative_k,
                                            min_survival_probability=args.speculative_survival)
        else:
            speculative = SpeculativeConfig(num_draft_tokens=args.speculative_k,
                                            confidence_threshold=args.speculative_threshold)
    llm = LLM(model, accelerator=args.accelerator, dtype=args.dtype, max_model_len=args.max_model_len,
              async_scheduling=not args.no_async, enforce_eager=args.enforce_eager, speculative=speculative,
              ep=args.ep, dp=args.dp, num_redundant_experts=args.num_redundant_experts,
              eplb_interval_steps=args.eplb_interval)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.generate(prompts, params)

    print(f"\nmodel {llm.checkpoint_dir} on backend {llm.backend.name} ({llm.backend.device}), {llm.dtype}")
    for output in outputs:
        print(f"\nprompt:     {output.prompt!r}\ncompletion: {output.outputs[0].text!r}")
    s = llm.rank_summaries()[0]
    if args.ep > 1 or args.dp > 1:
        print(f"\n{args.ep=} {args.dp=}: the figures below are rank 0's; EPLB re-placements: {llm.eplb_records()}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {generated} tokens generated in {s['steps']} steps "
        f"(mean batch {s['mean_batch_size']:.1f} sequences, {s['preemptions']} preemptions)\n"
        f"prefill {s['prefill_tokens']} tokens at {s['prefill_tokens_per_s']:.1f} tok/s, "
        f"decode {s['decode_tokens']} tokens at {s['decode_tokens_per_s']:.1f} tok/s\n"
        f"per step: device {s['device_ms_per_step']:.2f} ms, host {s['host_ms_per_step']:.2f} ms, "
        f"host waiting on the device {s['wait_ms_per_step']:.2f} ms"
    )
    if speculative is not None:
        per_position = [f"{s[f'spec_acceptance_rate_pos{j}']:.2f}" for j in range(args.speculative_k)
                        if f"spec_acceptance_rate_pos{j}" in s]
        print(
            f"speculative: {s['spec_accepted_tokens']} of {s['spec_draft_tokens']} drafts accepted "
            f"(rate {s['spec_acceptance_rate']:.2f}, per position {per_position}), "
            f"{s['spec_tokens_per_step']:.2f} tokens per sequence-step"
        )


if __name__ == "__main__":
    main()
