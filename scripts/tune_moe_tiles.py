"""Time the routed-expert grouped GEMM (`deepinfer_kernels.fused_moe`) over tile configurations.

For each (weight format, tokens) at V4-Flash widths: every candidate (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages), its output against the current default's (a config that changes the result beyond the bf16
accumulation tolerance is marked), its median time and TFLOP/s. Format `fp8-a8` is fp8 experts with fp8
activations (W8A8; only K tiles of one weight block apply). The table tells which defaults
`fused_moe.tile_config` should return; it is a script, not a test.

    python3 scripts/tune_moe_tiles.py --out $OUT
    python3 scripts/tune_moe_tiles.py --formats fp8,fp8-a8 --tokens 8192 --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from bench_model import fresh_ops
from kernel_bench_common import graph_time_ms, tiles_from, time_candidates, time_ms, write_table
from kernel_cases import stacked_experts

from deepinfer_kernels import fused_moe

CANDIDATES_M = (16, 64, 128)
CANDIDATES_NK = ((64, 64), (128, 64), (64, 128), (128, 128), (256, 128))
CANDIDATES_WARPS_STAGES = ((4, 3), (8, 3), (4, 4))
# decode-sized launches (a few rows per expert): narrow column tiles give the weight stream more programs
CANDIDATES_SMALL_NK = ((16, 128), (32, 128), (64, 128), (16, 256), (32, 256), (64, 64))
CANDIDATES_SMALL_WARPS_STAGES = ((2, 3), (2, 4), (4, 3), (4, 4), (4, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,8192")
    parser.add_argument("--formats", default="bf16,fp4")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from deepinfer_nvidia.ops import TritonOps

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter, experts, top_k = 4096, 2048, 256, 6
    default = fused_moe.tile_config
    lines = ["| format | tokens | BLOCK_M | BLOCK_N | BLOCK_K | warps | stages | ms | TFLOP/s | rel. diff vs default |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fmt in args.formats.split(","):
        mlps, _ = stacked_experts(experts, hidden, inter, fmt, gen, device, (128, 128))
        ops = fresh_ops(TritonOps, fmt)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
            ids = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=-1).indices
            weights = torch.rand(tokens, top_k, device=device, generator=gen) + 0.1
            flops = 2 * tokens * top_k * 3 * hidden * inter

            def run():
                return ops.fused_moe(x, weights, ids, mlps, None, 10.0)

            fused_moe.tile_config = default
            expected = run().float()
            small = tokens * top_k < 1024
            timer = graph_time_ms if small else time_ms  # decode sizes: device time, not the host's launches
            grid = itertools.product((16,), CANDIDATES_SMALL_NK, CANDIDATES_SMALL_WARPS_STAGES) if small else \
                itertools.product(CANDIDATES_M, CANDIDATES_NK, CANDIDATES_WARPS_STAGES)
            candidates = [(bm, bn, bk, warps, stages) for bm, (bn, bk), (warps, stages) in grid
                          if not (ops.fp8_activations and bk != 128)]  # W8A8: a K tile is one weight block
            results = time_candidates(run, expected, candidates, tiles_from(fused_moe), device, timer=timer)
            fused_moe.tile_config = default
            default_ms = timer(run, device, rep_ms=50)
            for ms, config, diff in results[:5]:
                lines.append(f"| {fmt} | {tokens} | " + " | ".join(map(str, config))
                             + f" | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff} |")
            lines.append(f"| {fmt} | {tokens} | default {default(tokens * top_k, fused_moe.weight_format(mlps[0].w1), False)}"
                         f" | | | | | {default_ms:.3f} | {flops / default_ms / 1e9:.0f} | 0 |")
            print("\n".join(lines[-6:]), flush=True)
    write_table(Path(args.out), "moe_tiles.md", lines)


if __name__ == "__main__":
    main()
