"""Time the sparse attention kernel (`deepinfer_kernels.sparse_attention`) over tile configurations.

For V4-Flash attention (64 heads sharing one 512-wide KV head, window 128, CSA top-512 / HCA entries) in
prefill and decode steps, on the path the model runs (`rotary_attention`: q normalised and rotated as it
loads, the output de-rotated as it stores): every candidate (BLOCK_H heads per program, BLOCK_N keys per
block, warps, stages), its output against the current default's, median time and TFLOP/s; for decode steps, the
default tiles under each bound on the key splits (`sparse_attention.MAX_KEY_SPLITS`). More heads per program
load each key once for more heads; fewer give a small decode step more programs. The table tells which
defaults `sparse_attention.tile_config` should return; it is a script, not a test.

    python3 scripts/tune_attention_tiles.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from kernel_bench_common import graph_time_ms, tiles_from, time_candidates, time_ms, write_table
from kernel_cases import _attention

from deepinfer_kernels import sparse_attention

CANDIDATES_H = (16, 32, 64)
# Not 16 warps: their 128-register cap spills ~900 bytes, inside the key loop on sm_90 (compile_kernels-style
# compile of the CSA rotary prefill program), where (32, 64, 8, 2) spills nothing on sm_90 or sm_100.
CANDIDATES_N_WARPS_STAGES = ((32, 4, 2), (32, 8, 2), (16, 8, 2), (64, 8, 1), (64, 8, 2))
# (step, sequences, new tokens each, cached context)
STEPS = (("prefill", 1, 4096, 0), ("prefill", 1, 8192, 0),
         ("decode", 1, 1, 8192), ("decode", 16, 1, 8192), ("decode", 64, 1, 8192))
KEY_SPLITS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="sliding,csa,hca")
    parser.add_argument("--steps", default="prefill,decode", help="which kinds of step to sweep")
    parser.add_argument("--splits-only", action="store_true", help="decode steps: only the key-split bounds")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from deepinfer_nvidia.ops import TritonOps

    device = torch.device("cuda")
    ops = TritonOps()
    default = sparse_attention.tile_config
    lines = ["| layer | step | seqs x tokens | BLOCK_H | BLOCK_N | warps | stages | ms | TFLOP/s | rel. diff vs default |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    steps = [step for step in STEPS if step[0] in args.steps.split(",")]
    for (kind, seqs, q_len, ctx), layer in itertools.product(steps, args.layers.split(",")):
        ratio = {"sliding": 0, "csa": 4, "hca": 128}[layer]
        gen = torch.Generator(device=device).manual_seed(0)
        run, _, flops, _, _, _ = _attention(ops, None, 64, 512, 128, seqs, q_len, ctx, layer, ratio, False, True,
                                             gen, device)
        timer = graph_time_ms if kind == "decode" else time_ms  # decode: device time, not the host's launches
        sparse_attention.tile_config = default
        expected = run().float()
        default_ms = timer(run, device, rep_ms=50)
        where = f"| {layer} | {kind} | {seqs} x {q_len} |"
        first_row = len(lines)
        if not args.splits_only:
            candidates = [(h, *nws) for h, nws in itertools.product(CANDIDATES_H, CANDIDATES_N_WARPS_STAGES)]
            results = time_candidates(run, expected, candidates, tiles_from(sparse_attention), device, timer=timer)
            sparse_attention.tile_config = default
            for ms, config, diff in results[:4]:
                lines.append(f"{where} " + " | ".join(map(str, config)) + f" | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff} |")
        default_config = default(seqs * q_len, 512, torch.bfloat16, False)
        lines.append(f"{where} default {default_config} | | | | {default_ms:.3f} | {flops / default_ms / 1e9:.0f} | 0 |")
        default_splits = sparse_attention.MAX_KEY_SPLITS
        for splits in KEY_SPLITS if kind == "decode" else ():
            sparse_attention.MAX_KEY_SPLITS = splits
            ms = timer(run, device, rep_ms=50)
            diff = float((run().float() - expected).norm() / expected.norm())
            lines.append(f"{where} default tiles, at most {splits} key splits | | | | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.1e} |")
        sparse_attention.MAX_KEY_SPLITS = default_splits
        print("\n".join(lines[first_row:]), flush=True)
    write_table(Path(args.out), "attention_tiles.md", lines)


if __name__ == "__main__":
    main()
