"""DeepSeek-V4.1 decode benchmark: one decode step per sequence of a batch, eager against replayed from a
CUDA graph (the engine's default), on a slice of the V4.1-Flash release widths (MODEL_SPEC_V41 §1.1).

The slice: five layers covering every role — sliding (0); a ratio-2 KV source that is an index source
with an engram (1); a Reuse layer of its band (2); a ratio-1 KV source that is the candidate source (3); a
Reindex layer picking inside its candidates (4). Weights as the release stores them (fp8 32x32 block
projections, fp4 experts, fp8 shared expert) with random values made on the device; the KV cache in the
release formats (fp8 window, fp4 entries and index keys) holding random state for the context. The engram
tables are smaller than the release's (`--engram-vocab`; rows are read zero-copy from host memory).
Printed per row: eager and replayed step ms, their ratio, steps/s, tokens/s, the bytes the step must read
(weights with the routed experts the step's routing touches, plus the KV it attends and scores) and the
step time over that floor (bytes / measured copy bandwidth). Written to $OUT (or --out):
decode_v41.json, decode_v41.txt, decode_v41.png.

GPU:  python3 scripts/bench_decode_v41.py --batches 1,16,64 --contexts 4096
CPU:  python3 scripts/bench_decode_v41.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(REPO / "backends" / "nvidia"), str(REPO / "scripts")]

from bench_model import counting_experts, randomise_parameter, replayed_decode, setup, step_batch, weight_bytes  # noqa: E402
from bench_prefill import _ints  # noqa: E402
from kernel_bench_common import cell, finish_plot, new_plot, recorded, sweep_ceilings, time_ms, write_table  # noqa: E402

from deepinfer_core.models.deepseek_v41 import (  # noqa: E402
    DeepseekV41Cache, DeepseekV41ForCausalLM, parse_deepseek_v41_config,
)
from deepinfer_core.models.deepseek_v41.kv_quant import kv_formats  # noqa: E402

SLICE_ROLES: dict[str, Any] = {
    "num_hidden_layers": 5, "compress_ratios": [0, 2, 2, 1, 1], "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": 3, "engram_layer_ids": [1],
    "num_nextn_predict_layers": 0, "dspark_target_layer_ids": [0, 2, 4],
}
TINY_WIDTHS: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 32,
    "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "candidate_topk_blocks": 2,
    "candidate_block_size": 4, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4,
    "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "hc_mult": 2,
    "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32, "engram_compressed_vocab_size": 256,
}
RELEASE_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                        "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def slice_config(tiny: bool, engram_vocab: int):
    """The slice's typed config: the release widths (the defaults of `DeepseekV41TextConfig`) or toy ones."""
    text = {"model_type": "deepseek_v41_text", **SLICE_ROLES, **(TINY_WIDTHS if tiny else {}),
            "engram_vocab_size": engram_vocab}
    return parse_deepseek_v41_config({"text_config": text, "quantization_config": RELEASE_QUANTIZATION})


def build_model(config, ops, device: torch.device) -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(config, ops, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(0)
    host = torch.Generator().manual_seed(0)
    for name, tensor in model.state_dict().items():  # the engram tables live in host memory
        randomise_parameter(name, tensor, config.text_config, host if tensor.device.type == "cpu" else gen)
    c = config.text_config
    model.bind_token_map([t % c.engram_compressed_vocab_size for t in range(c.vocab_size)])
    return model


def random_cache(config, batch, block_size: int, device: torch.device) -> DeepseekV41Cache:
    """Random state for every position below context_len (codes of finite values: the fp4 scales and the
    fp8 ue8m0 exponents near 1), a spare slot and block for the graph's padding rows."""
    blocks = sum(sum(1 for b in table if b >= 0) for table in batch.block_tables_cpu)
    gen = torch.Generator(device=device).manual_seed(99)

    def allocate(shape, dtype):
        if dtype == torch.uint8:
            return torch.randint(120, 130, shape, device=device, generator=gen, dtype=torch.uint8)
        return torch.randn(shape, device=device, generator=gen).to(dtype)

    return DeepseekV41Cache(config, num_blocks=blocks + 1, block_size=block_size, num_slots=batch.num_seqs + 1,
                            dtype=torch.bfloat16, allocate=allocate)


def kv_bytes_per_sequence(config, context: int) -> float:
    """KV bytes one decode token must read, in the release's formats: every layer's window; each
    attending layer's top-k of its band's visible entries; each index source's scores over every visible
    index key."""
    c = config.text_config
    formats = kv_formats(c.head_dim, c.index_head_dim, "fp8_fp4")
    window = formats.window.bytes_per_vector(c.head_dim, torch.bfloat16)
    entry = formats.entry.bytes_per_vector(c.head_dim, torch.bfloat16)
    key = formats.index.bytes_per_vector(c.index_head_dim, torch.bfloat16)
    total = 0.0
    for layer, ratio in enumerate(c.compress_ratios[: c.num_hidden_layers]):
        total += min(context, c.sliding_window) * window
        if ratio:
            visible = (context + 1) // ratio
            total += min(visible, c.index_topk) * entry
            if layer in c.index_source_layer_ids:
                total += visible * key
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", type=_ints, default=None, help="default 1,16,64 (--tiny: 2)")
    parser.add_argument("--contexts", type=_ints, default=None, help="default 4096")
    parser.add_argument("--engram-vocab", type=int, default=None, help="engram_vocab_size (release 16,000,000)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    batches = args.batches or ([2] if args.tiny else [1, 16, 64])
    contexts = args.contexts or ([20] if args.tiny else [4096])
    device, ops = setup(args.tiny)
    ceilings = sweep_ceilings(device, args.tiny)
    config = slice_config(args.tiny, args.engram_vocab or (61 if args.tiny else 40_000))
    model = build_model(config, ops, device)
    block_size = 8
    rows: list[dict] = []
    for context in contexts:
        for size in batches:
            with recorded(rows, {"batch": size, "context": context}, device) as row:
                _measure(row, model, config, ops, size, context, block_size, device, ceilings)
    _report(rows, ceilings, Path(args.out))


def _measure(row, model, config, ops, size, context, block_size, device, ceilings) -> None:
    batch = step_batch([1] * size, [context] * size, block_size, device)
    cache = random_cache(config, batch, block_size, device)
    # NOTE: the engram look-back in the cache is all DEAD, as at a sequence's start: same work as later.

    def forward_logits():
        return model.compute_logits(model(batch, cache).hidden[batch.logits_indices])

    with counting_experts(ops, "fused_moe_prescaled") as touched:
        eager = forward_logits()
    row["finite"] = bool(torch.isfinite(eager).all())
    row["eager_ms"] = ms = time_ms(forward_logits, device, rep_ms=200)
    if device.type == "cuda":
        replay = replayed_decode(model, cache, batch, block_size, device)
        row["graph_max_abs_diff"] = float((replay() - forward_logits()).abs().max())
        row["graph_ms"] = ms = time_ms(replay, device, rep_ms=200)
    experts = statistics.mean(touched)
    nbytes = weight_bytes(model, experts, config.text_config.n_routed_experts) + size * kv_bytes_per_sequence(config, context)
    floor_ms = nbytes / (ceilings.copy_gbps * 1e9) * 1e3
    row.update(ms=ms, eager_over_graph=row["eager_ms"] / ms, steps_per_s=1e3 / ms, tokens_per_s=size * 1e3 / ms,
               experts_touched=experts, gbytes=nbytes / 1e9, floor_ms=floor_ms, over_floor=ms / floor_ms)


def _report(rows: list[dict], ceilings, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_v41.json").write_text(json.dumps({"ceilings": ceilings.describe(), "rows": rows}, indent=1))
    columns = (("batch", "batch", "d"), ("context", "context", "d"), ("eager ms", "eager_ms", ".3f"),
               ("graph ms", "graph_ms", ".3f"), ("eager/graph", "eager_over_graph", ".2f"),
               ("steps/s", "steps_per_s", ".1f"), ("tok/s", "tokens_per_s", ".0f"), ("experts", "experts_touched", ".1f"),
               ("GB", "gbytes", ".2f"), ("floor ms", "floor_ms", ".3f"), ("x floor", "over_floor", ".2f"),
               ("graph diff", "graph_max_abs_diff", ".2g"))
    lines = [" | ".join(name for name, _, _ in columns)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']} | {r['context']} | {r['error']}")
        else:
            lines.append(" | ".join(cell(r.get(key), spec) for _, key, spec in columns))
    text = f"{ceilings.describe()}\n" + "\n".join(lines)
    write_table(out, "decode_v41.txt", text.splitlines())
    print(text)
    plot = new_plot()
    if plot is None:
        return
    fig, ax = plot
    for context in sorted({r["context"] for r in rows}):
        for key, label in (("eager_ms", "eager"), ("graph_ms", "CUDA graph"), ("floor_ms", "bandwidth floor")):
            points = [(r["batch"], r[key]) for r in rows if r["context"] == context and r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{label}, context {context}")
    ax.set_title("DeepSeek-V4.1 slice (release widths, fp8 / fp4), one decode step")
    finish_plot(fig, ax, out / "decode_v41.png", "batch (sequences)", "step ms", x_log_base=2, y_log=True)


if __name__ == "__main__":
    main()
