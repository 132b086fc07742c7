"""Shared by the kernel check and the benchmarks: measured ceilings, timing, output poisoning, and which
transformers ran beside DeepInfer.

Ceilings are measured on the device the script runs on, never taken from a datasheet: a large bf16
(and, where torch can, fp8) matrix product and a large device-to-device copy (bytes read + written).
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Ceilings", "cell", "collect_rows", "finish_plot", "free_memory", "graph_time_ms", "measure_ceilings",
    "poison_allocator", "recorded", "sweep_ceilings", "time_ms", "transformers_line", "transformers_release",
    "write_table",
]


@dataclass(frozen=True, slots=True)
class Ceilings:
    bf16_tflops: float
    fp8_tflops: float | None
    copy_gbps: float

    def describe(self) -> str:
        fp8 = f"{self.fp8_tflops:.0f}" if self.fp8_tflops else "n/a"
        return f"bf16 matmul {self.bf16_tflops:.0f} TFLOP/s, fp8 matmul {fp8} TFLOP/s, copy {self.copy_gbps:.0f} GB/s"


def transformers_release(version: str | None = None) -> tuple[str, str, bool]:
    """(transformers' version, the installed one unless given; deepinfer's requirement on it; whether it meets it).
    transformers is the reference for DeepSeek-V4 only from the required release: older ones' DeepSeek-V4 differs
    (5.17's stopped on a float / bf16 dtype mismatch inside its own attention), so a comparison names the release."""
    from importlib import metadata

    from packaging.requirements import Requirement

    wanted = next(r for r in map(Requirement, metadata.requires("deepinfer") or ()) if r.name == "transformers")
    version = version or metadata.version("transformers")
    return version, str(wanted), wanted.specifier.contains(version, prereleases=True)


def transformers_line(version: str | None = None) -> str:
    """A report's line naming the transformers release that ran side by side, flagged when below the requirement."""
    version, wanted, meets = transformers_release(version)
    below = "" if meets else f" (below deepinfer's {wanted}: not its reference)"
    return f"side by side: transformers {version}{below}"


def time_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 100) -> float:
    """Median milliseconds per call: triton's do_bench (device events) on a GPU, a host clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graph_time_ms(fn: Callable[[], object], device: torch.device, calls: int = 20, rep_ms: int = 50) -> float:
    """Median milliseconds per call of `calls` calls of fn captured in one CUDA graph: device time without
    the host's launch overhead, as a captured decode step pays it (a decode-sized kernel takes less
    time than its launches, so `time_ms` would time the host). Captured as the engine captures a step:
    warmed up on a side stream first (`CudaMemoryManager.capture_graph`)."""
    from deepinfer_nvidia.cuda_memory import CudaMemoryManager

    graph = CudaMemoryManager(device).capture_graph(lambda: [fn() for _ in range(calls)])
    return time_ms(graph.replay, device, rep_ms) / calls


def measure_ceilings(device: torch.device, size: int = 8192, copy_bytes: int = 2 << 30, samples: int = 3) -> Ceilings:
    """Each rate from the fastest of `samples` median timings: one H100's bf16 rate read 708 to 797 TFLOP/s across
    calls (its clocks), and a fraction of the fastest the card showed is the one that does not flatter."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(size, size, device=device, generator=gen).to(torch.bfloat16)
    flops = 2 * size**3

    def best_rate(work: float, fn: Callable[[], object]) -> float:
        return work / min(time_ms(fn, device) for _ in range(samples))

    bf16 = best_rate(flops, lambda: a @ b) / 1e9
    fp8 = None
    if device.type == "cuda":
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            fp8 = best_rate(flops, lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
        except (RuntimeError, AttributeError) as err:
            print(f"fp8 matmul ceiling not measured: {err}")
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_(generator=gen)
    dst = torch.empty_like(src)
    copy = best_rate(2 * copy_bytes, lambda: dst.copy_(src)) / 1e6
    return Ceilings(bf16, fp8, copy)


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill `nbytes` of the caching allocator's free memory with NaN bytes (0xFF) and release it, so
    outputs the kernels allocate next start as NaN: an element they fail to write shows up as NaN."""
    if device.type != "cuda":
        return
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    block.fill_(0xFF)
    del block


def new_plot():
    """(figure, axes) for a benchmark PNG, or None where matplotlib is missing (tables still get written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt.subplots(figsize=(7, 4.5))


def save_plot(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def finish_plot(fig, ax, path, xlabel: str, ylabel: str, *, x_log_base: int | None = None, y_log: bool = False) -> None:
    """Label, grid, legend and save a benchmark plot (log axes where asked)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if x_log_base:
        ax.set_xscale("log", base=x_log_base)
    if y_log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_plot(fig, path)


def time_candidates(
    run: Callable[[], torch.Tensor], expected: torch.Tensor, candidates: Iterable[Any], apply: Callable[[Any], None],
    device: torch.device, rep_ms: int = 50, timer: Callable[..., float] = time_ms,
) -> list[tuple[float, Any, str]]:
    """(median ms, candidate, relative difference of run()'s output from `expected`) for each candidate
    put in place by apply(candidate) (a tile sweep patches the kernel module's tile function), fastest
    first (timed by `timer`: `graph_time_ms` for decode-sized launches); a candidate that fails (e.g.
    does not compile) is a row with inf ms and the error's name.
    The caller puts its default back."""
    results = []
    for candidate in candidates:
        apply(candidate)
        try:
            got = run().float()
            diff = float((got - expected).norm() / expected.norm())
            ms = timer(run, device, rep_ms=rep_ms)
        except Exception as err:  # noqa: BLE001  (a candidate that does not compile is a row, not a stop)
            results.append((float("inf"), candidate, type(err).__name__))
            continue
        results.append((ms, candidate, f"{diff:.1e}"))
    return sorted(results, key=lambda r: r[0])


def tiles_from(module: Any) -> Callable[[Any], None]:
    """`time_candidates`' apply for a kernel module whose `tile_config(...)` picks its tiles: the
    candidate becomes what tile_config returns."""
    return lambda config: setattr(module, "tile_config", lambda *_: config)


def write_table(out: Path, name: str, lines: list[str]) -> None:
    """The markdown table `lines` as out/name (out created)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("\n".join(lines) + "\n")


def sweep_ceilings(device: torch.device, tiny: bool) -> Ceilings:
    """The benchmarks' ceilings (toy sizes with --tiny), printed."""
    ceilings = measure_ceilings(device, size=256 if tiny else 8192, copy_bytes=(1 << 22) if tiny else (2 << 30))
    print("measured ceilings:", ceilings.describe(), flush=True)
    return ceilings


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def recorded(rows: list[dict], row: dict, device: torch.device) -> Iterator[dict]:
    """Fill `row` in the block; a failure becomes the row's `error` (the sweep goes on). The row is
    appended and printed either way, and the device memory freed."""
    try:
        yield row
    except Exception as err:  # noqa: BLE001  (one failed point is a row of the table, not the end of the run)
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"
    rows.append(row)
    print(row, flush=True)
    free_memory(device)


def collect_rows(
    weights: list[str],
    deepinfer_rows: Callable[[str], list[dict]],
    hf_rows: Callable[[], list[dict]] | None,
    device: torch.device,
) -> list[dict]:
    """DeepInfer's rows for each weight format, then transformers' (None: skipped); a run that fails
    as a whole becomes one error row."""
    runs = [("deepinfer", w, lambda w=w: deepinfer_rows(w)) for w in weights]
    if hf_rows is not None:
        runs.append(("transformers", "bf16", hf_rows))
    rows: list[dict] = []
    for impl, weight, run in runs:
        try:
            rows += run()
        except Exception as err:  # noqa: BLE001  (the other formats still run)
            traceback.print_exc()
            rows.append({"impl": impl, "weights": weight, "error": f"{type(err).__name__}: {err}"})
        free_memory(device)
    return rows


def cell(value: float | None, spec: str) -> str:
    """A table cell: `value` formatted, or '-' where it was not measured."""
    return "-" if value is None else format(value, spec)
