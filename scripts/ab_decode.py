"""A/B of the decode step between this tree and a baseline tree (a commit's sources exported with `git archive REV
deepinfer_core kernels backends scripts tests | tar -x -C DIR`, carried to the GPU machine): `bench_decode.py` from each tree in a process of its own (each
imports its own tree's modules), alternating, --rounds times, then per (weights, batch, context) the median
step time of each tree and their ratio. One call on one warm GPU measures a change against its base, where
figures from different sessions (and cards) do not compare.

python3 scripts/ab_decode.py --baseline ab/base [--rounds 2] -- --weights bf16,fp4 --batches 1,16,64 --contexts 4096 --no-hf
CPU:  python3 scripts/ab_decode.py --baseline ab/base --rounds 1 -- --tiny --batches 1 --contexts 64 --no-hf
Written to $OUT (or --out): ab_decode.txt, ab_decode.json; each run's own output under base_<i>/ and new_<i>/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts")]

from kernel_bench_common import cell  # noqa: E402


def _run(tree: Path, bench_args: list[str], out: Path) -> dict[tuple, float]:
    """{(weights, batch, context): step ms} of DeepInfer's rows from `tree`'s bench_decode.py."""
    subprocess.run([sys.executable, str(tree / "scripts" / "bench_decode.py"), *bench_args, "--out", str(out)],
                   check=True)
    rows = json.loads((out / "decode.json").read_text())["rows"]
    return {(r["weights"], r["batch"], r["context"]): r["ms"] for r in rows if r["impl"] == "deepinfer" and "ms" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="the baseline tree (its scripts/bench_decode.py)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating (base first)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_decode.py's arguments")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    if not (args.baseline / "scripts" / "bench_decode.py").exists():
        parser.error(f"{args.baseline} holds no scripts/bench_decode.py")
    runs: dict[str, list[dict[tuple, float]]] = {"base": [], "new": []}
    for i in range(args.rounds):
        for tag, tree in (("base", args.baseline), ("new", REPO)):
            runs[tag].append(_run(tree, bench_args, args.out / f"{tag}_{i}"))
    keys = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs)))
    rows = []
    for key in keys:
        base, new = (statistics.median(r[key] for r in runs[tag]) for tag in ("base", "new"))
        rows.append({"weights": key[0], "batch": key[1], "context": key[2], "base_ms": base, "new_ms": new,
                     "base_runs": [r[key] for r in runs["base"]], "new_runs": [r[key] for r in runs["new"]]})
    lines = [f"baseline {args.baseline}, {args.rounds} rounds, bench_decode.py {' '.join(bench_args)}",
             f"{'weights':<8}{'batch':>6}{'ctx':>6}{'base_ms':>9}{'new_ms':>9}{'new/base':>9}{'delta_us':>10}"]
    for r in rows:
        lines.append(f"{r['weights']:<8}{r['batch']:>6}{r['context']:>6}{cell(r['base_ms'], '.3f'):>9}"
                     f"{cell(r['new_ms'], '.3f'):>9}{cell(r['new_ms'] / r['base_ms'], '.3f'):>9}"
                     f"{cell((r['new_ms'] - r['base_ms']) * 1e3, '+.1f'):>10}")
    lines.append("ms: the median over the rounds of each tree's step time (a device graph's replay on a GPU)")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab_decode.txt").write_text(table)
    (args.out / "ab_decode.json").write_text(json.dumps(rows, indent=1))
    print(table)


if __name__ == "__main__":
    main()
