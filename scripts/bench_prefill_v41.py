"""DeepSeek-V4.1 prefill benchmark: tokens per step against step latency on the V4.1-Flash slice of
`bench_decode_v41.py` (release widths; fp8 32x32 projections, fp4 experts, fp8 shared expert; random values).

Each step is uncached prompts of --seq-len tokens, logits for the last token of each, as `bench_prefill.py`
runs V4; the same columns: step ms, tokens/s, model FLOPs per token (weights, attention as the slice reads
it, the LM head) and the achieved fraction of the measured fp8 matmul rate. The first size's logits are
compared with the reference ops on the same weights. No transformers column: V4.1's reference lives in
transformers' source tree only. Weights "fp8-fp4-a8" runs the fp8 projections on fp8 activations (W8A8).
Written to $OUT (or --out): prefill_v41.json, prefill_v41.txt, prefill_v41.png.

GPU:  python3 scripts/bench_prefill_v41.py
CPU:  python3 scripts/bench_prefill_v41.py --tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(REPO / "backends" / "nvidia"), str(REPO / "scripts")]

from bench_decode_v41 import build_model, random_cache, slice_config  # noqa: E402
from bench_model import fresh_ops, setup  # noqa: E402
from bench_prefill import add_step_arguments, prefill_rows, step_sizes, write_report  # noqa: E402
from kernel_bench_common import collect_rows, sweep_ceilings  # noqa: E402

BLOCK_SIZE = 8  # a multiple of every compression ratio of the slice (1, 2) and of the candidate block (8)


def attention_flops(config, positions: torch.Tensor) -> float:
    """Summed over tokens at `positions`: 4 * heads * head_dim per key attended (window, then up to index_topk
    of the band's visible entries in each layer of ratio > 0) plus each index source's scores over every
    visible index key (the keys `bench_decode_v41.kv_bytes_per_sequence` counts)."""
    c = config.text_config
    pos = positions.double()
    total = torch.zeros_like(pos)
    for layer, ratio in enumerate(c.compress_ratios[: c.num_hidden_layers]):
        keys = torch.clamp(pos + 1, max=c.sliding_window)
        if ratio:
            visible = torch.floor((pos + 1) / ratio)
            keys = keys + torch.clamp(visible, max=c.index_topk)
            if layer in c.index_source_layer_ids:
                total += 2 * c.index_n_heads * c.index_head_dim * visible
        total += 4 * c.num_attention_heads * c.head_dim * keys
    return float(total.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--weights", default="fp8-fp4", help="comma list of fp8-fp4 (the release's), fp8-fp4-a8")
    parser.add_argument("--engram-vocab", type=int, default=None, help="engram_vocab_size (release 16,000,000)")
    args = parser.parse_args()
    tokens, seq_len = step_sizes(args)
    device, ops = setup(args.tiny)
    ceilings = sweep_ceilings(device, args.tiny)
    config = slice_config(args.tiny, args.engram_vocab or (61 if args.tiny else 40_000))
    text = config.text_config

    def rows(weights: str) -> list[dict]:
        if weights not in ("fp8-fp4", "fp8-fp4-a8"):
            raise ValueError(f"unknown weights {weights!r}: the V4.1 slice holds the release's fp8-fp4")
        model_ops = fresh_ops(type(ops), weights)
        model = build_model(config, model_ops, device)
        return prefill_rows(model, model_ops, weights, tokens, seq_len, BLOCK_SIZE, device, ceilings,
                            lambda batch: random_cache(config, batch, BLOCK_SIZE, device),
                            lambda positions: attention_flops(config, positions), text.hidden_size * text.vocab_size,
                            moe_op="fused_moe_prescaled")

    write_report(collect_rows(args.weights.split(","), rows, None, device), ceilings, Path(args.out), "prefill_v41")


if __name__ == "__main__":
    main()
