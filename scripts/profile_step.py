"""Where a prefill or decode step of the benchmark model spends its time, per KernelOps op.

Every op of the backend's ops object is wrapped in a profiler range named `op:<name>`, so the table
shows device time per op (nested ops count in both) beside the top kernels, and the step's wall time
beside its summed kernel time (the gap is host overhead: launches, Python, synchronisation).

On a GPU an op can stand in the table twice: as its range on the GPU timeline (host ms 0; device ms the span from its
first kernel's start to its last's end, so in an eager step the host's gaps between the op's launches count in), and
as its host range (host ms; device ms only of the kernels attributed to it: cuBLAS's and torch's, while Triton's
launches were not, in every run so far). A kernel's own time is in the kernel table; the graph replay has no gaps.
H100, fp4 decode at batch 1, eager: `fused_moe` 395 us a call as a GPU range, its two kernels 43 + 23 us.

    python3 scripts/profile_step.py --out $OUT            # on the GPU
    python3 scripts/profile_step.py --tiny --out /tmp/p   # toy widths, Triton interpreter, CPU
"""

from __future__ import annotations

import argparse
import functools
import inspect
import time
from pathlib import Path

import torch
from bench_model import build_deepinfer, flash_slice_raw, fresh_ops, random_cache, replayed_decode, setup, step_batch

from deepinfer_core.platform.kernel_ops import KernelOps


def _label_ops(ops: KernelOps) -> None:
    for name, _ in inspect.getmembers(KernelOps, inspect.isfunction):
        if name.startswith("_"):
            continue
        method = getattr(ops, name)

        @functools.wraps(method)
        def labelled(*args, _method=method, _name=name, **kwargs):
            with torch.profiler.record_function(f"op:{_name}"):
                return _method(*args, **kwargs)

        setattr(ops, name, labelled)


def _profile(step, device: torch.device, title: str, rows: int) -> str:
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3 if device.type == "cuda" else float("nan")
    ops_table = [e for e in events if e.key.startswith("op:")]
    ops_table.sort(key=lambda e: -(e.device_time_total if device.type == "cuda" else e.cpu_time_total))
    lines = [f"## {title}", f"wall {wall_ms:.2f} ms, summed kernel time {kernel_ms:.2f} ms", "",
             f"{'op':32s} {'calls':>6s} {'device ms':>10s} {'host ms':>10s}"]
    for e in ops_table:
        lines.append(f"{e.key:32s} {e.count:6d} {e.device_time_total / 1e3:10.3f} {e.cpu_time_total / 1e3:10.3f}")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    lines += ["", events.table(sort_by=sort, row_limit=rows, max_name_column_width=60), "",
              f"host side: {launches} kernel launches; top calls by self host time:",
              events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--decode-batches", default="1,64")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, ops = setup(args.tiny)
    ops = fresh_ops(type(ops), args.weights)
    _label_ops(ops)
    bench = build_deepinfer(flash_slice_raw(args.tiny, args.weights), ops, device)
    model, config = bench.model, bench.config
    block_size = 2 * max(config.compress_ratios)
    prefill = 64 if args.tiny else args.prefill_tokens
    context = 64 if args.tiny else args.context
    reports = []
    with torch.no_grad():
        batch = step_batch([prefill], [0], block_size, device)
        cache = random_cache(config, batch, block_size, device)
        reports.append(_profile(lambda: model.compute_logits(model(batch, cache).hidden[batch.logits_indices]),
                                device, f"prefill {prefill} tokens, {args.weights}", args.rows))
        for size in (int(b) for b in args.decode_batches.split(",")):
            batch = step_batch([1] * size, [context] * size, block_size, device)
            cache = random_cache(config, batch, block_size, device, spare=1)
            reports.append(_profile(lambda: model.compute_logits(model(batch, cache).hidden[batch.logits_indices]),
                                    device, f"decode batch {size} at context {context}, {args.weights}", args.rows))
            if device.type == "cuda":  # as the engine runs it: kernels only, the host's launches gone
                reports.append(_profile(replayed_decode(model, cache, batch, block_size, device), device,
                                        f"decode batch {size} at context {context}, {args.weights}, graph replay",
                                        args.rows))
    text = "\n".join(reports)
    (out / f"profile_{args.weights}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
