"""Time the hyper-connection mixing kernel (`deepinfer_kernels.hyper_connection.hc_mix`) over tile configurations.

At V4-Flash width (4 streams of 4096, 20 Sinkhorn iterations) for decode- and prefill-sized steps: every
candidate (CHUNK columns per partial sum, BLOCK_K, BLOCK_T rows per program, warps) of the partial
launch, its output against the current default's, the median time of both launches (replayed from a
CUDA graph up to 64 tokens, where launching takes longer than the kernels) and the fraction
of the measured copy bandwidth that reading the streams once would take. The table tells which
defaults `hyper_connection.tile_config` should return; it is a script, not a test.

    python3 scripts/tune_hc_tiles.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from kernel_bench_common import graph_time_ms, measure_ceilings, tiles_from, time_candidates, time_ms, write_table

from deepinfer_kernels import hyper_connection

CANDIDATES_CHUNK_K = ((128, 32), (128, 64), (128, 128), (256, 64), (256, 128), (512, 64), (512, 128), (1024, 64))
CANDIDATES_T_WARPS = ((16, 2), (16, 4), (32, 4), (64, 4), (64, 8), (128, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,8192")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device).copy_gbps
    gen = torch.Generator(device=device).manual_seed(0)
    n, d = 4, 4096
    fn = torch.randn(2 * n + n * n, n * d, device=device, generator=gen) / 64
    base = torch.randn(2 * n + n * n, device=device, generator=gen)
    scale = torch.rand(3, device=device, generator=gen)
    default = hyper_connection.tile_config
    lines = ["| tokens | CHUNK | BLOCK_K | BLOCK_T | warps | ms | copy-bandwidth fraction | rel. diff vs default |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens in (int(t) for t in args.tokens.split(",")):
        streams = torch.randn(tokens, n, d, device=device, generator=gen).to(torch.bfloat16)
        floor_ms = (streams.numel() * 2 + fn.numel() * 4) / copy_gbps / 1e6

        def run():
            return torch.cat([part.reshape(tokens, -1) for part in hyper_connection.hc_mix(streams, fn, base, scale, 1e-6, 1e-6, 20)], 1)

        timer = graph_time_ms if tokens <= 64 else time_ms
        hyper_connection.tile_config = default
        expected = run().float()
        default_ms = timer(run, device, rep_ms=50)
        candidates = [(chunk, bk, bt, warps) for (chunk, bk), (bt, warps) in itertools.product(CANDIDATES_CHUNK_K, CANDIDATES_T_WARPS)
                      if not (tokens <= 64 and bt > 16) and bk <= chunk]
        results = time_candidates(run, expected, candidates, tiles_from(hyper_connection), device, timer=timer)
        hyper_connection.tile_config = default
        for ms, config, diff in results[:5]:
            lines.append(f"| {tokens} | " + " | ".join(map(str, config)) + f" | {ms:.4f} | {floor_ms / ms:.2f} | {diff} |")
        lines.append(f"| {tokens} | default {default(tokens, False)} | | | | {default_ms:.4f} | {floor_ms / default_ms:.2f} | 0 |")
        print("\n".join(lines[-6:]), flush=True)
    write_table(Path(args.out), "hc_tiles.md", lines)


if __name__ == "__main__":
    main()
