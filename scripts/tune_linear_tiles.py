"""Time the linear kernel (`deepinfer_kernels.linear`) over tile configurations.

For each projection shape of the V4-Flash slice and each row count: every candidate (BLOCK_N, BLOCK_K,
warps, stages) with K split to fill `split` x the SMs (0: no split; up to 64 rows), its output against the
current default's, median time, the weight bytes' rate against the measured copy bandwidth and TFLOP/s. Each row
count keeps the default's row tile (`linear.tile_config`: 16, 32, 64 or 128 rows). `--format fp8-a8` times fp8
weights with fp8 activations (W8A8). The table tells which tiles `linear.tile_config` should give (its rule, or
a measured tile in `linear.FP8_DECODE_TILES`); it is a script, not a test.

Up to 64 rows (decode) each time is a CUDA graph's replay of calls that cycle through copies of the weight
filling DECODE_STREAM_BYTES, so that every call reads its weight from memory as a decode step does: timed
eagerly, a decode-sized launch times the host's launch (BENCHMARKS.md), and replayed over one copy, a weight
of a few MB sits in L2.

    python3 scripts/tune_linear_tiles.py --out $OUT
    python3 scripts/tune_linear_tiles.py --rows 16,32,64 --format fp8 --out $OUT
    python3 scripts/tune_linear_tiles.py --rows 8192 --format fp8-a8 --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path

import torch
from kernel_bench_common import graph_time_ms, measure_ceilings, tiles_from, time_candidates, time_ms, write_table

from deepinfer_core.quantization import quantize_fp8_block
from deepinfer_kernels import linear

# (name, groups, N, K): attention and shared-expert projections (wq_a and wkv also as the one launch of a
# decode step's `LinearGroup`), the grouped output projection, the output projection, the LM head
SHAPES = (("wq_a", 1, 1024, 4096), ("wkv", 1, 512, 4096), ("wq_a+wkv", 1, 1536, 4096), ("wo_a", 8, 1024, 4096),
          ("wo_b", 1, 4096, 8192), ("shared_w2", 1, 4096, 2048), ("wq_b", 1, 32768, 1024), ("head", 1, 129280, 4096))
DECODE_STREAM_BYTES = 256 << 20  # weight copies a decode-sized timing cycles through: 5x an H100's 50 MB L2
CANDIDATES_NK = ((32, 128), (64, 64), (64, 128), (64, 256), (128, 128), (256, 64), (256, 128))
CANDIDATES_WARPS_STAGES = ((4, 3), (4, 4), (8, 3), (8, 4))
CANDIDATES_SPLIT = (0, 1, 2, 4)  # split K to fill this many times the SMs (0 = never split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--format", default="bf16", choices=("bf16", "fp8", "fp8-a8"))
    parser.add_argument("--shapes", default=",".join(name for name, *_ in SHAPES),
                        help="comma list of projection names")
    parser.add_argument("--top", type=int, default=4, help="candidates a (shape, rows) row of the table keeps")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = measure_ceilings(device).copy_gbps
    gen = torch.Generator(device=device).manual_seed(0)
    default_tiles = linear.tile_config
    lines = [f"copy bandwidth {bandwidth:.0f} GB/s, {sms} SMs", "",
             f"format {args.format}", "",
             "| shape | rows | BLOCK_N | BLOCK_K | warps | stages | split x SMs | ms | GB/s | % copy | TFLOP/s | rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    block = None if args.format == "bf16" else (128, 128)
    shapes = [shape for shape in SHAPES if shape[0] in args.shapes.split(",")]
    for (name, groups, n, k), m in itertools.product(shapes, (int(r) for r in args.rows.split(","))):
        dense = torch.randn(groups * n, k, device=device, generator=gen) / 64
        weight, scale = (dense.to(torch.bfloat16), None) if block is None else quantize_fp8_block(dense, block)
        x = torch.randn(m, groups, k, device=device, generator=gen).to(torch.bfloat16)
        nbytes, flops = weight.numel() * weight.element_size(), 2 * m * groups * n * k
        decode = m <= 64
        weights = [weight] + [weight.clone() for _ in range(DECODE_STREAM_BYTES // nbytes if decode else 0)]
        turn = itertools.cycle(weights)
        timer = functools.partial(graph_time_ms, calls=max(len(weights), 20)) if decode else time_ms

        def run():
            w = next(turn)
            if groups == 1:
                return linear.linear(x[:, 0], w, scale, block, False, sms, args.format == "fp8-a8")
            return linear.grouped_linear(x, w, scale, block, False, sms, args.format == "fp8-a8")

        linear.tile_config = default_tiles
        expected = run().float()
        default_ms = timer(run, device, rep_ms=40)
        # decode batches of 17-64 rows take 32- and 64-row tiles that split K too (`linear.split_k`)
        splits = CANDIDATES_SPLIT if decode else (0,)
        block_m = default_tiles(m, 0 if block is None else 1, False, groups * n)[0]
        candidates = [
            (block_m, bn, bk, warps, stages, fill)
            for (bn, bk), (warps, stages), fill in itertools.product(CANDIDATES_NK, CANDIDATES_WARPS_STAGES, splits)
            # fp8 tiles lie inside one scale block and span its K (W8A8: one activation group)
            if block is None or (bk == block[1] and bn <= block[0])
        ]
        results = time_candidates(run, expected, candidates, tiles_from(linear), device, rep_ms=40, timer=timer)
        linear.tile_config = default_tiles
        for ms, config, diff in results[:args.top]:
            gbps = nbytes / ms / 1e6
            tiles = " | ".join(str(v) for v in config[1:])  # BLOCK_N, BLOCK_K, warps, stages, split fill
            lines.append(f"| {name} {groups}x{n}x{k} | {m} | {tiles} | {ms:.4f} | {gbps:.0f} | "
                         f"{100 * gbps / bandwidth:.0f}% | {flops / ms / 1e9:.0f} | {diff} |")
        gbps = nbytes / default_ms / 1e6
        lines.append(f"| {name} {groups}x{n}x{k} | {m} | default | | | | | {default_ms:.4f} | {gbps:.0f} | "
                     f"{100 * gbps / bandwidth:.0f}% | {flops / default_ms / 1e9:.0f} | 0 |")
        print("\n".join(lines[-1 - min(args.top, len(results)):]), flush=True)
    write_table(Path(args.out), "linear_tiles.md", lines)


if __name__ == "__main__":
    main()
