"""Check and time every Triton kernel of the nvidia backend against the reference ops, at real shapes.

Per case: fresh random inputs, outputs allocated from NaN-poisoned memory, the kernel's output against
the reference op's (relative error in float64, a NaN fails), then median times (triton do_bench) of
kernel and reference, with achieved TFLOP/s and GB/s as fractions of the matmul rate and copy bandwidth
measured at the start. Each case runs in its own try block; a table is printed last and everything is
written to $OUT (or --out): kernels.json, kernels.txt. Then the backend conformance suite runs.

GPU:   python3 scripts/check_kernels_gpu.py
CPU:   python3 scripts/check_kernels_gpu.py --tiny   (toy shapes through the Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels"), str(REPO / "backends" / "nvidia"), str(REPO / "scripts")]


@dataclass
class Row:
    case: str
    status: str
    rel_error: float | None = None
    tolerance: float | None = None
    kernel_ms: float | None = None
    reference_ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    matmul_fraction: float | None = None
    copy_fraction: float | None = None
    detail: str = ""


@dataclass
class Case:
    name: str
    build: Callable[[torch.Generator, torch.device], tuple]  # -> (kernel_fn, reference_fn, flops, bytes, tol, fp8)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("nan")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU: through TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for kernels.json/.txt")
    parser.add_argument("--only", default="", help="run only cases whose name contains one of these (comma list)")
    parser.add_argument("--no-reference-timing", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        sys.path.insert(0, str(REPO / "tests"))
        import triton_interpreter  # noqa: F401  (TRITON_INTERPRET=1 before the kernels import)
    from deepinfer_core.platform.kernel_ops import KernelOps
    from deepinfer_nvidia.ops import TritonOps
    from kernel_bench_common import measure_ceilings, poison_allocator, time_ms
    from kernel_cases import kernel_cases

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    ceilings = measure_ceilings(device, size=512 if args.tiny else 8192, copy_bytes=(1 << 24) if args.tiny else (2 << 30))
    print("measured ceilings:", ceilings.describe(), flush=True)
    ops, reference = TritonOps(), KernelOps()
    rows: list[Row] = []
    for case in kernel_cases(ops, reference, args.tiny):
        if not any(wanted in case.name for wanted in args.only.split(",")):
            continue
        row = Row(case.name, "FAIL")
        try:
            gen = torch.Generator(device=device).manual_seed(len(rows) + 1)
            kernel, ref_fn, flops, nbytes, tol, fp8 = case.build(gen, device)
            poison_allocator(device, 1 << 30)
            out, expected = _values(kernel()), _values(ref_fn())
            row.rel_error, row.tolerance = rel_error(out, expected), tol
            del out, expected
            row.status = "PASS" if row.rel_error <= tol else "FAIL"
            row.kernel_ms = time_ms(kernel, device)
            if not args.no_reference_timing:
                row.reference_ms = time_ms(ref_fn, device, rep_ms=40)
            seconds = row.kernel_ms / 1e3
            row.tflops, row.gbps = flops / seconds / 1e12, nbytes / seconds / 1e9
            rate = ceilings.fp8_tflops if fp8 and ceilings.fp8_tflops else ceilings.bf16_tflops
            row.matmul_fraction, row.copy_fraction = row.tflops / rate, row.gbps / ceilings.copy_gbps
        except Exception as err:  # one case failing must not hide the others
            row.status, row.detail = "ERROR", f"{type(err).__name__}: {err}"
            traceback.print_exc()
        rows.append(row)
        print(_line(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    conformance = _conformance(device)
    table = _table(rows, ceilings.describe(), conformance)
    (out_dir / "kernels.json").write_text(json.dumps(
        {"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows], "conformance": conformance}, indent=1))
    (out_dir / "kernels.txt").write_text(table)
    print(table)


def _values(result: object) -> object:
    """A case's result as the check compares it: fp8 codes (`QuantizedActivations`) as their values."""
    from deepinfer_core.platform.kernel_ops import QuantizedActivations

    return result.dequantize() if isinstance(result, QuantizedActivations) else result


def _conformance(device: torch.device) -> str:
    if device.type != "cuda":
        return "conformance: skipped on the CPU (runs on the GPU)"
    try:
        from deepinfer_core.platform.conformance import run_conformance
        from deepinfer_nvidia.backend import NvidiaBackend

        return run_conformance(NvidiaBackend()).summary()
    except Exception as err:
        traceback.print_exc()
        return f"conformance: ERROR {type(err).__name__}: {err}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(r: Row) -> str:
    speedup = r.reference_ms / r.kernel_ms if r.reference_ms and r.kernel_ms else None
    return (f"{r.case:<44} {r.status:<5} {_fmt(r.rel_error, '.2e'):>9} {_fmt(r.tolerance, '.0e'):>6} "
            f"{_fmt(r.kernel_ms, '.4f'):>10} {_fmt(r.reference_ms, '.3f'):>10} {_fmt(speedup, '.1f'):>7} "
            f"{_fmt(r.tflops, '.1f'):>8} {_fmt(r.matmul_fraction and 100 * r.matmul_fraction, '.1f'):>6} "
            f"{_fmt(r.gbps, '.0f'):>7} {_fmt(r.copy_fraction and 100 * r.copy_fraction, '.1f'):>6} {r.detail[:60]}")


def _table(rows: list[Row], ceilings: str, conformance: str) -> str:
    head = (f"{'case':<44} {'stat':<5} {'rel_err':>9} {'tol':>6} {'kernel_ms':>10} {'ref_ms':>10} {'speedup':>7} "
            f"{'TFLOP/s':>8} {'%mm':>6} {'GB/s':>7} {'%copy':>6}")
    passed = sum(r.status == "PASS" for r in rows)
    return "\n".join([f"ceilings (measured): {ceilings}", head, *(_line(r) for r in rows),
                      f"{passed}/{len(rows)} kernel cases passed", conformance.splitlines()[-1] if conformance else ""])


if __name__ == "__main__":
    main()
