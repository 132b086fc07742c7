"""Issue 10's first check: greedy outputs of the tiny checkpoint with ep=2, dp=2 and ep=2+dp=2 with EPLB
re-placements equal one device's, on `--accelerator` (nvidia: one GPU per rank, NCCL; cpu: gloo).

    NCCL_NVLS_ENABLE=0 python scripts/check_parallel_gpu.py --out $OUT/parallel.json   # 2 GPUs
    python scripts/check_parallel_gpu.py --accelerator cpu --out /tmp/parallel.json     # gloo
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools import make_tiny_checkpoint

LAYOUTS = {
    "ep2": {"ep": 2},
    "dp2": {"dp": 2},
    "ep2_dp2_eplb": {"ep": 2, "dp": 2, "num_redundant_experts": 2, "eplb_interval_steps": 8},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=gen).tolist()}
               for n in torch.randint(4, 60, (args.prompts,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(**options) -> dict:
        started = time.perf_counter()
        llm = LLM(str(path), accelerator=args.accelerator, dtype="float32", num_kv_blocks=512, **options)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        records = [str(r) for r in llm.eplb_records()]
        llm.shutdown()
        return {"tokens": tokens, "seconds": time.perf_counter() - started, "eplb": records}

    single = run()
    report = {"one_device_seconds": single["seconds"]}
    for name, options in LAYOUTS.items():
        try:
            result = run(**options)
            report[name] = {"equal_to_one_device": result["tokens"] == single["tokens"],
                            "seconds": result["seconds"], "eplb": result["eplb"]}
        except Exception as err:  # noqa: BLE001  (one layout's failure is a row of the report)
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        print(name, report[name], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
