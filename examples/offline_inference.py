"""Generate completions for a batch of prompts and print what the engine did.

    python examples/offline_inference.py [--model_name ID_OR_PATH] [--max_tokens N] [--temperature T]
                                         [--speculative-k K [--speculative-threshold T]]

The model is `--model_name`, else DEEPINFER_HF_MODEL_DIR, else (on a machine whose backend is the
`cpu` one) a tiny random checkpoint written on first use to ~/.cache/deepinfer/tiny-deepseek-v4,
else the default hub checkpoint. DEEPINFER_ACCELERATOR picks the backend.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer_core import LLM, SamplingParams, SpeculativeConfig, envs
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
    parser.add_argument("--speculative-k", type=int, default=0,
                        help="draft up to K tokens per step with the checkpoint's MTP layer (0 = off)")
    parser.add_argument("--speculative-threshold", type=float, default=0.0,
                        help="stop drafting once a draft's own probability falls below this")
    args = parser.parse_args()
    speculative = None
    if args.speculative_k:
        speculative = SpeculativeConfig(num_draft_tokens=args.speculative_k,
                                        confidence_threshold=args.speculative_threshold)

    model = pick_model(args.model_name, args.accelerator)
    llm = LLM(model, accelerator=args.accelerator, dtype=args.dtype, max_model_len=args.max_model_len,
              async_scheduling=not args.no_async, speculative=speculative)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.generate(prompts, params)

    print(f"\nmodel {llm.checkpoint_dir} on backend {llm.backend.name} ({llm.backend.device}), {llm.dtype}")
    for output in outputs:
        print(f"\nprompt:     {output.prompt!r}\ncompletion: {output.outputs[0].text!r}")
    s = llm.engine.stats.summary()
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
