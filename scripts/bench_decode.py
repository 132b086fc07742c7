"""Decode benchmark (issue 5): one decode step per sequence of a batch, swept over batch size and
context length on the V4-Flash 4-layer slice, DeepInfer (nvidia backend ops) beside transformers.

DeepInfer's cache holds random state for the context (as after a prefill: validity follows positions),
so long contexts cost no prefill; transformers is prefilled with --hf-context tokens per sequence and then
timed one step at a time. Printed per row: step ms, steps/s, tokens/s per GPU and per request, bytes the
step must read (weights + KV, routed experts counted as the step's routing selects them) and the bandwidth
floor (bytes / measured copy bandwidth), step time / floor, the floor under uniform routing, model FLOPs
per token, transformers' step time and the ratio.
Written to $OUT (or --out): decode.json, decode.txt, decode.png.
With --speculative, instead: speculative decoding (oracle drafts of chosen acceptance, real MTP draft
cost) against plain decoding, written to spec_decode.{txt,json,png} (see bench_speculative.py).

GPU:  python3 scripts/bench_decode.py
CPU:  python3 scripts/bench_decode.py --tiny
GPU:  python3 scripts/bench_decode.py --speculative --batches 1,16,64 --contexts 4096
CPU:  python3 scripts/bench_decode.py --speculative --tiny
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
    attention_flops, build_deepinfer, build_transformers, counting_experts, expected_experts_touched, flash_slice_raw,
    fresh_ops, kv_bytes_per_sequence, random_cache, replayed_decode, setup, step_batch, weight_bytes,
    weight_flops_per_token,
)
from bench_prefill import _ints  # noqa: E402
from bench_speculative import run_speculative  # noqa: E402
from kernel_bench_common import (  # noqa: E402
    cell, collect_rows, finish_plot, new_plot, recorded, sweep_ceilings, time_ms, transformers_line,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", type=_ints, default=None, help="default 1,16,64,256")
    parser.add_argument("--contexts", type=_ints, default=None, help="default 256,4096")
    parser.add_argument("--weights", default="bf16,fp4")
    parser.add_argument("--hf-context", type=int, default=None, help="transformers' prefilled context (default 256)")
    parser.add_argument("--hf-max-batch", type=int, default=64)
    parser.add_argument("--hf-steps", type=int, default=8, help="decode steps timed on transformers")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--speculative", action="store_true", help="speculative vs plain decoding (first --contexts, first --weights)")
    parser.add_argument("--k", type=int, default=3, help="--speculative: drafts verified per step")
    parser.add_argument("--acceptance", type=_floats, default=[0.0, 0.5, 0.8, 1.0], help="--speculative: oracle's per-draft acceptance")
    parser.add_argument("--spec-steps", type=int, default=None, help="--speculative: verification steps per run (default 16, tiny 5)")
    parser.add_argument("--spec-min-samples", type=int, default=None,
                        help="--speculative: more steps at small batches, until batch x steps >= this (default 128, tiny 0)")
    parser.add_argument("--rep-ms", type=int, default=50, help="--speculative: do_bench repetition time per measurement")
    args = parser.parse_args()
    if args.speculative:
        device, ops = setup(args.tiny)
        run_speculative(
            args.tiny, args.weights.split(",")[0], args.batches or ([1, 3] if args.tiny else [1, 16, 64]),
            (args.contexts or ([20] if args.tiny else [4096]))[0], args.k, args.acceptance,
            args.spec_steps or (5 if args.tiny else 16),
            args.spec_min_samples if args.spec_min_samples is not None else (0 if args.tiny else 128),
            args.rep_ms, device, ops, Path(args.out),
        )
        return
    batches = args.batches or ([1, 3] if args.tiny else [1, 16, 64, 256])
    contexts = args.contexts or ([20] if args.tiny else [256, 4096])
    hf_context = args.hf_context or (20 if args.tiny else 256)
    device, ops = setup(args.tiny)
    ceilings = sweep_ceilings(device, args.tiny)
    hf_batches = [b for b in batches if b <= args.hf_max_batch]
    rows = collect_rows(
        args.weights.split(","), lambda w: _deepinfer_rows(args.tiny, w, batches, contexts, device, ops, ceilings),
        None if args.no_hf else lambda: _hf_rows(args.tiny, hf_batches, hf_context, args.hf_steps, device), device,
    )
    _report(rows, ceilings, Path(args.out))


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def _deepinfer_rows(tiny, weights, batches, contexts, device, ops, ceilings):
    ops = fresh_ops(type(ops), weights)
    bench = build_deepinfer(flash_slice_raw(tiny, weights), ops, device)
    model, config = bench.model, bench.config
    block_size = 2 * max(config.compress_ratios)
    per_token = weight_flops_per_token(model) + 2 * config.hidden_size * config.vocab_size
    rate = ceilings.fp8_tflops if weights != "bf16" and ceilings.fp8_tflops else ceilings.bf16_tflops
    rows = []
    for context in contexts:
        for size in batches:
            batch = step_batch([1] * size, [context] * size, block_size, device)
            with recorded(rows, {"impl": "deepinfer", "weights": weights, "batch": size, "context": context},
                          device) as row:
                cache = random_cache(config, batch, block_size, device, spare=1)

                def forward_logits(step_batch):
                    return model.compute_logits(model(step_batch, cache).hidden[step_batch.logits_indices])

                with counting_experts(ops) as touched:
                    eager = forward_logits(batch)
                row["finite"] = bool(torch.isfinite(eager).all())
                row["eager_ms"] = time_ms(lambda: forward_logits(batch), device, rep_ms=200)
                ms = row["eager_ms"]
                if device.type == "cuda":  # the engine's default: the step replayed from a device graph
                    replay = replayed_decode(model, cache, batch, block_size, device)
                    row["graph_max_abs_diff"] = float((replay() - eager).abs().max())
                    row["graph_ms"] = ms = time_ms(replay, device, rep_ms=200)
                # The floor counts the experts this step's routing selected (mean over the MoE layers); the
                # uniform-routing estimate is printed beside it.
                experts = statistics.mean(touched)
                kv = size * kv_bytes_per_sequence(config, context)
                nbytes = weight_bytes(model, experts) + kv
                floor_ms = nbytes / (ceilings.copy_gbps * 1e9) * 1e3
                uniform_bytes = weight_bytes(model, expected_experts_touched(config, size)) + kv
                uniform_ms = uniform_bytes / (ceilings.copy_gbps * 1e9) * 1e3
                flops = per_token * size + attention_flops(config, batch.positions)
                row.update(ms=ms, steps_per_s=1e3 / ms, tokens_per_s=size * 1e3 / ms, tokens_per_s_per_request=1e3 / ms,
                           experts_touched=experts, uniform_floor_ms=uniform_ms,
                           gbytes=nbytes / 1e9, floor_ms=floor_ms, over_floor=ms / floor_ms,
                           gflop_per_token=flops / size / 1e9, matmul_fraction=flops / ms / 1e9 / rate)
    return rows


def _hf_rows(tiny, batches, context, steps, device):
    model = build_transformers(flash_slice_raw(tiny, "bf16"), device)
    rows = []
    for size in batches:
        with recorded(rows, {"impl": "transformers", "weights": "bf16", "batch": size, "context": context},
                      device) as row, torch.no_grad():
            ids = torch.randint(0, 97, (size, context), device=device)
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(steps):
                times.append(_timed(lambda: model(token, past_key_values=cache, use_cache=True), device))
                token = (token + 1) % 97
            ms = statistics.median(times)
            row.update(ms=ms, steps_per_s=1e3 / ms, tokens_per_s=size * 1e3 / ms, tokens_per_s_per_request=1e3 / ms)
    return rows


def _timed(fn, device) -> float:
    if device.type != "cuda":
        import time

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _report(rows, ceilings, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    hf = {r["batch"]: r["ms"] for r in rows if r["impl"] == "transformers" and "ms" in r}
    lines = [f"ceilings (measured): {ceilings.describe()}", *([transformers_line()] if hf else []),
             f"{'impl':<13}{'weights':<8}{'batch':>6}{'ctx':>6}{'step_ms':>9}{'steps/s':>9}{'tok/s':>9}{'tok/s/req':>10}"
             f"{'experts':>8}{'GB/step':>8}{'floor_ms':>9}{'x_floor':>10}{'unif_ms':>8}{'GFLOP/tok':>10}{'%mm':>7}{'hf_ms':>8}{'x_hf':>6}{'eager_ms':>9}"
             f"{'graph_diff':>11}  error"]
    for r in rows:
        ms, ref = r.get("ms"), hf.get(r.get("batch")) if r["impl"] == "deepinfer" else None
        lines.append(
            f"{r['impl']:<13}{r['weights']:<8}{cell(r.get('batch'), 'd'):>6}{cell(r.get('context'), 'd'):>6}{cell(ms, '.2f'):>9}"
            f"{cell(r.get('steps_per_s'), '.1f'):>9}{cell(r.get('tokens_per_s'), '.0f'):>9}{cell(r.get('tokens_per_s_per_request'), '.1f'):>10}"
            f"{cell(r.get('experts_touched'), '.1f'):>8}{cell(r.get('gbytes'), '.2f'):>8}{cell(r.get('floor_ms'), '.2f'):>9}"
            f"{cell(r.get('over_floor'), '.2f'):>10}{cell(r.get('uniform_floor_ms'), '.2f'):>8}"
            f"{cell(r.get('gflop_per_token'), '.2f'):>10}{cell(r.get('matmul_fraction') and 100 * r['matmul_fraction'], '.2f'):>7}"
            f"{cell(ref, '.2f'):>8}{cell(ref / ms if ref and ms else None, '.2f'):>6}"
            f"{cell(r.get('eager_ms'), '.2f'):>9}{cell(r.get('graph_max_abs_diff'), '.2g'):>11}  {r.get('error', '')[:80]}"
        )
    lines.append("experts: distinct routed experts per MoE layer in this step's routing (mean), which floor_ms "
                 "counts; unif_ms is the floor with uniform routing's expected count instead.")
    lines.append("x_hf compares DeepInfer at its context with transformers at --hf-context (same batch). On a GPU "
                 "step_ms is the step replayed from a device graph (the engine's default), eager_ms the same step "
                 "launched op by op; graph_diff = max |logit difference| between the two.")
    table = "\n".join(lines)
    (out / "decode.txt").write_text(table)
    (out / "decode.json").write_text(json.dumps({"ceilings": ceilings.describe(), "rows": rows}, indent=1))
    _plot(rows, out / "decode.png")
    print(table)


def _plot(rows, path: Path) -> None:
    plot = new_plot()
    if plot is None:
        return
    fig, ax = plot
    for key in sorted({(r["impl"], r["weights"], r.get("context", 0)) for r in rows}):
        pts = sorted((r["batch"], r["ms"]) for r in rows if (r["impl"], r["weights"], r.get("context", 0)) == key and "ms" in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]} ctx {key[2]}")
    floor = sorted((r["batch"], r["floor_ms"]) for r in rows if "floor_ms" in r and r["weights"] == "bf16")
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="bf16 bandwidth floor")
    finish_plot(fig, ax, path, "batch (sequences, one token each)", "decode step latency (ms, 4-layer slice)",
                x_log_base=2, y_log=True)


if __name__ == "__main__":
    main()
