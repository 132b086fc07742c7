"""Prefill benchmark (issue 5): tokens per step against step latency on the V4-Flash 4-layer slice,
DeepInfer (nvidia backend ops) beside transformers' DeepseekV4ForCausalLM, same config, same run.

Each step is uncached prompts (context 0) of --seq-len tokens (fewer when the step is smaller), logits
for the last token of each. Printed per row: step ms, tokens/s, model FLOPs per token, achieved TFLOP/s
and its fraction of the measured bf16 matmul rate (fp8 rate for fp8/fp4 weights), the weight bytes the step
reads and their fraction of the measured copy bandwidth, transformers' time and the ratio; for the first
size, the error against the reference ops (rel_err: the logits; tok_med / tok_max / >0.1: each token's final
hidden state, median, largest, share above 0.1). Written to $OUT (or --out): prefill.json, prefill.txt,
prefill.png.

GPU:  python3 scripts/bench_prefill.py
CPU:  python3 scripts/bench_prefill.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(REPO / "backends" / "nvidia"), str(REPO / "scripts")]

from bench_model import (  # noqa: E402
    attention_flops, build_deepinfer, build_transformers, counting_experts, flash_slice_raw, fresh_ops, random_cache,
    setup, step_batch, use_ops, weight_bytes, weight_flops_per_token,
)
from kernel_bench_common import (  # noqa: E402
    cell, collect_rows, finish_plot, new_plot, recorded, sweep_ceilings, time_ms, transformers_line,
)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments both prefill benchmarks take (`step_sizes` reads the sizes)."""
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=_ints, default=None, help="tokens per step (default 4096,8192,16384,"
                        "32768,65536: a size the card cannot hold is an error row)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per prompt (default 8192)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))


def step_sizes(args: argparse.Namespace) -> tuple[list[int], int]:
    """(tokens per step, tokens per prompt): the arguments, or the defaults of a GPU or a --tiny run."""
    sweep = [24, 48] if args.tiny else [4096, 8192, 16384, 32768, 65536]
    return args.tokens or sweep, args.seq_len or (24 if args.tiny else 8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--weights", default="bf16,fp4", help="comma list of bf16, fp8, fp4; fp8-a8 / fp4-a8 add fp8 activations (W8A8 projections)")
    parser.add_argument("--hf-max-tokens", type=int, default=8192, help="largest step run on transformers")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    tokens, seq_len = step_sizes(args)
    device, ops = setup(args.tiny)
    ceilings = sweep_ceilings(device, args.tiny)
    hf_tokens = [t for t in tokens if t <= args.hf_max_tokens]
    rows = collect_rows(
        args.weights.split(","), lambda w: _deepinfer_rows(args.tiny, w, tokens, seq_len, device, ops, ceilings),
        None if args.no_hf else lambda: _hf_rows(args.tiny, hf_tokens, seq_len, device), device,
    )
    write_report(rows, ceilings, Path(args.out))


def _deepinfer_rows(tiny, weights, tokens, seq_len, device, ops, ceilings):
    ops = fresh_ops(type(ops), weights)
    bench = build_deepinfer(flash_slice_raw(tiny, weights), ops, device)
    config = bench.config
    block_size = 2 * max(config.compress_ratios)
    return prefill_rows(bench.model, ops, weights, tokens, seq_len, block_size, device, ceilings,
                        lambda batch: random_cache(config, batch, block_size, device),
                        lambda positions: attention_flops(config, positions), config.hidden_size * config.vocab_size)


def prefill_rows(model, ops, weights, tokens, seq_len, block_size, device, ceilings, make_cache, attention, head_size,
                 moe_op="fused_moe"):
    """A row per step size in `tokens` (uncached prompts of seq_len, logits of each prompt's last token):
    step ms, tokens/s, FLOPs per token (weights, attention(positions), the LM head of head_size weights a
    logit row) and their rate against the matmul ceiling of the weights' format; the bytes of the weights the
    step reads (the routed experts its routing touches, counted at `ops.<moe_op>`; activations and cache not
    counted: a lower bound) and their rate against the copy ceiling; the first size's logits against the
    reference ops. V4's and V4.1's benchmarks alike."""
    per_token = weight_flops_per_token(model)
    routed = getattr(model.config, "text_config", model.config).n_routed_experts
    rate = ceilings.fp8_tflops if weights != "bf16" and ceilings.fp8_tflops else ceilings.bf16_tflops
    rows = []
    for total in tokens:
        lens = [min(seq_len, total - start) for start in range(0, total, seq_len)]
        batch = step_batch(lens, [0] * len(lens), block_size, device)
        cache = make_cache(batch)

        def hidden():
            return model(batch, cache).hidden

        def step():
            return model.compute_logits(hidden()[batch.logits_indices])

        with recorded(rows, {"impl": "deepinfer", "weights": weights, "tokens": total, "seqs": len(lens)}, device) as row:
            with counting_experts(ops, moe_op) as touched:
                got = hidden()
            logits = model.compute_logits(got[batch.logits_indices])
            nbytes = weight_bytes(model, statistics.mean(touched), routed)
            if total == tokens[0]:
                _compare_with_reference_ops(row, got, logits, hidden, batch.logits_indices, model, ops, weights)
            row["finite"] = bool(torch.isfinite(logits).all())
            ms = time_ms(step, device, rep_ms=300)
            flops = per_token * total + attention(batch.positions) + 2 * head_size * len(lens)
            row.update(ms=ms, tokens_per_s=total / ms * 1e3, gflop_per_token=flops / total / 1e9,
                       tflops=flops / ms / 1e9, matmul_fraction=flops / ms / 1e9 / rate, gbytes=nbytes / 1e9,
                       copy_fraction=nbytes / ms / 1e6 / ceilings.copy_gbps)
    return rows


def _compare_with_reference_ops(row, got, logits, hidden, logits_rows, model, ops, weights) -> None:
    """`got` (the step's final hidden states) and `logits` (each prompt's last token's) against the same step,
    hidden(), on the reference ops: the relative error of the logits and, token by token, of the final hidden
    state (median, largest, share of tokens above 0.1). One token's logits move by tens of percent when a near-tie flips one of its expert or entry picks; the spread over the
    tokens tells such flips from an error every token shares. The reference ops hold each layer's attention
    scores at once ([heads, tokens, entries] float32: 16 GiB at 8,192 tokens), so where the card lacks the room
    (an 80 GB H100 at 8,192 tokens) the row says there was no check, and the step is still timed."""
    from deepinfer_core.platform.kernel_ops import KernelOps

    use_ops(model, fresh_ops(KernelOps, weights))
    try:
        expected = hidden()
        expected_logits = model.compute_logits(expected[logits_rows])
        row["logits_rel_error_vs_reference_ops"] = float((logits - expected_logits).norm() / expected_logits.norm())
        per_token = (got.float() - expected.float()).norm(dim=-1) / expected.float().norm(dim=-1)
        row.update(hidden_rel_error_median=float(per_token.median()), hidden_rel_error_max=float(per_token.max()),
                   hidden_tokens_over_0p1=float((per_token > 0.1).float().mean()))
    except torch.OutOfMemoryError as err:
        row["note"] = f"no reference check: the reference ops ran out of memory ({str(err).split('.')[0]})"
    finally:
        use_ops(model, ops)


def _hf_rows(tiny, tokens, seq_len, device):
    raw = flash_slice_raw(tiny, "bf16")
    model = build_transformers(raw, device)
    rows = []
    for total in tokens:
        n = max(1, total // seq_len)
        ids = torch.randint(0, 97, (n, min(seq_len, total)), device=device)
        with recorded(rows, {"impl": "transformers", "weights": "bf16", "tokens": n * ids.shape[1], "seqs": n},
                      device) as row, torch.no_grad():
            ms = time_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), device, rep_ms=300)
            row.update(ms=ms, tokens_per_s=row["tokens"] / ms * 1e3)
    return rows


def write_report(rows, ceilings, out: Path, name: str = "prefill") -> None:
    """out/<name>.txt, .json and .png: the table, the rows, the plot."""
    out.mkdir(parents=True, exist_ok=True)
    hf = {r["tokens"]: r["ms"] for r in rows if r["impl"] == "transformers" and "ms" in r}
    lines = [f"ceilings (measured): {ceilings.describe()}", *([transformers_line()] if hf else []),
             f"{'impl':<13}{'weights':<11}{'tokens':>7}{'seqs':>5}{'step_ms':>10}{'tok/s':>10}{'GFLOP/tok':>10}"
             f"{'TFLOP/s':>9}{'%mm':>6}{'GB':>7}{'%copy':>6}{'hf_ms':>9}{'x_hf':>7}{'rel_err':>9}{'tok_med':>9}{'tok_max':>9}{'>0.1':>6}  error"]
    for r in rows:
        ms, ref = r.get("ms"), hf.get(r.get("tokens"))
        ratio = ref / ms if ms and ref and r["impl"] == "deepinfer" else None
        lines.append(
            f"{r['impl']:<13}{r['weights']:<11}{cell(r.get('tokens'), 'd'):>7}{cell(r.get('seqs'), 'd'):>5}{cell(ms, '.2f'):>10}"
            f"{cell(r.get('tokens_per_s'), '.0f'):>10}{cell(r.get('gflop_per_token'), '.2f'):>10}{cell(r.get('tflops'), '.1f'):>9}"
            f"{cell(r.get('matmul_fraction') and 100 * r['matmul_fraction'], '.1f'):>6}"
            f"{cell(r.get('gbytes'), '.1f'):>7}{cell(r.get('copy_fraction') and 100 * r['copy_fraction'], '.1f'):>6}"
            f"{cell(ref if r['impl'] == 'deepinfer' else None, '.2f'):>9}{cell(ratio, '.2f'):>7}"
            f"{cell(r.get('logits_rel_error_vs_reference_ops'), '.1e'):>9}{cell(r.get('hidden_rel_error_median'), '.1e'):>9}"
            f"{cell(r.get('hidden_rel_error_max'), '.1e'):>9}{cell(r.get('hidden_tokens_over_0p1'), '.1%'):>6}"
            f"  {r.get('error', r.get('note', ''))[:80]}"
        )
    table = "\n".join(lines)
    (out / f"{name}.txt").write_text(table)
    (out / f"{name}.json").write_text(json.dumps({"ceilings": ceilings.describe(), "rows": rows}, indent=1))
    _plot(rows, out / f"{name}.png")
    print(table)


def _plot(rows, path: Path) -> None:
    plot = new_plot()
    if plot is None:
        return
    fig, ax = plot
    for key in sorted({(r["impl"], r["weights"]) for r in rows}):
        pts = sorted((r["ms"], r["tokens_per_s"], r["tokens"]) for r in rows if (r["impl"], r["weights"]) == key and "ms" in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
            for ms, tps, n in pts:
                ax.annotate(str(n), (ms, tps), fontsize=7)
    finish_plot(fig, ax, path, "step latency (ms)", "prefill tokens/s per GPU (the benchmark's layer slice)", x_log_base=10)


if __name__ == "__main__":
    main()
