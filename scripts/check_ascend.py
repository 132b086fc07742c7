"""On an Ascend NPU (CANN 9.2, torch_npu): the first proof of the `ascend` backend, into one report.

Nothing of the ascend backend has run on Ascend hardware before this script. It runs, in order, and
keeps going after a failed step so the report shows everything at once:
  1. the backend check: `select_backend("ascend")` with its device, CANN and torch_npu versions, capabilities;
  2. conformance (what `deepinfer check-backend ascend` runs): every op of AscendOps against the
     reference ops on the NPU, per op and dtype;
  3. the tiny random checkpoint end to end: greedy continuations on `ascend` against the `cpu`
     backend, float32 and bfloat16, with the leading tokens that agree and the wall time;
  4. each op AscendOps overrides timed against its reference, on the NPU, at model-like shapes.

    python scripts/check_ascend.py --report ascend_report.txt [--prompts 8] [--tokens 24]

Exit status 0 only when the check, conformance and the float32 greedy comparison all pass (bfloat16
continuations of a random checkpoint may legitimately diverge on near-tied logits: reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.platform.conformance import run_conformance
from deepinfer_core.platform.interfaces import Backend, BackendUnavailable
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights
from deepinfer_core.platform.registry import select_backend
from deepinfer_core.tools.tiny_checkpoint import make_tiny_checkpoint


def check_backend(report: list[str]) -> Backend:
    backend = select_backend("ascend")
    report.append(f"backend: {type(backend).__name__} ({type(backend.ops()).__name__})")
    report.extend(f"  {key}: {value}" for key, value in backend.describe().items())
    report.append(f"  capabilities: {backend.capabilities()}")
    return backend


def check_conformance(backend: Backend, report: list[str]) -> bool:
    result = run_conformance(backend)
    report.append(result.summary())
    return result.passed


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_generation(prompts_n: int, tokens: int, report: list[str]) -> bool:
    checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (1 + (i * 37) % 120,), generator=gen).tolist() for i in range(prompts_n)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    float32_ok = True
    for dtype in ("float32", "bfloat16"):
        outputs = {}
        for accelerator in ("cpu", "ascend"):
            llm = LLM(model=str(checkpoint), accelerator=accelerator, dtype=dtype, max_num_batched_tokens=256)
            started = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            report.append(f"generate {dtype} on {accelerator}: {time.perf_counter() - started:.2f} s "
                          f"({prompts_n} prompts x {tokens} tokens, tiny checkpoint)")
            outputs[accelerator] = [list(out.outputs[0].token_ids) for out in outs]
            del llm
        agree = [leading_agreement(a, b) for a, b in zip(outputs["cpu"], outputs["ascend"])]
        full = sum(n == tokens for n in agree)
        report.append(f"  {dtype}: {full}/{prompts_n} continuations identical to cpu; leading agreement {agree}")
        if dtype == "float32":
            float32_ok = full == prompts_n
    return float32_ok


def _timed(backend: Backend, fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds of `fn` on the device, after warm-up."""
    memory = backend.memory()
    for _ in range(3):
        fn()
    start, end = memory.new_event(enable_timing=True), memory.new_event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    memory.synchronize()
    return start.elapsed_time(end) / iters


def time_overrides(backend: Backend, report: list[str]) -> None:
    ops, reference, device = backend.ops(), KernelOps(), backend.device
    dtype = torch.bfloat16

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    tokens, hidden, heads, head_dim, rope_dim = 512, 4096, 64, 512, 64
    x, norm_w = randn(tokens, hidden), torch.randn(hidden, device=device)
    q, positions = randn(tokens, heads, head_dim), torch.arange(tokens, device=device) + 1000
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))
    n_experts, top_k, inter = 32, 6, 1024
    experts = [MlpWeights(randn(inter, hidden, scale=0.02), randn(inter, hidden, scale=0.02),
                          randn(hidden, inter, scale=0.02)) for _ in range(n_experts)]
    ids = torch.stack([torch.randperm(n_experts, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=device)
    cases = {
        f"rms_norm [{tokens}, {hidden}] bf16, f32 weight": lambda o: o.rms_norm(x, norm_w, 1e-6),
        f"rope [{tokens}, {heads}, {head_dim}] bf16, rope dim {rope_dim}": lambda o: o.rope(q, positions, inv_freq),
        f"fused_moe T={tokens} D={hidden} I={inter} E={n_experts} k={top_k} bf16":
            lambda o: o.fused_moe(x, weights, ids, experts, experts[0], 10.0),
    }
    report.append("overridden ops on the NPU (mean ms, AscendOps vs reference KernelOps):")
    for name, call in cases.items():
        fused, plain = _timed(backend, lambda: call(ops)), _timed(backend, lambda: call(reference))
        report.append(f"  {name}: {fused:.3f} ms vs {plain:.3f} ms ({plain / fused:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=Path("ascend_report.txt"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    report: list[str] = [f"check_ascend.py, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}"]
    passed = {"backend check": False, "conformance": False, "float32 greedy vs cpu": False}
    backend = None
    steps: list[tuple[str, Callable[[], object]]] = [
        ("backend check", lambda: check_backend(report)),
        ("conformance", lambda: check_conformance(backend, report)),
        ("float32 greedy vs cpu", lambda: check_generation(args.prompts, args.tokens, report)),
        ("op timings", lambda: time_overrides(backend, report)),
    ]
    for name, step in steps:
        if backend is None and name != "backend check":
            report.append(f"{name}: skipped (no backend)")
            continue
        report.append(f"--- {name}")
        try:
            result = step()
        except BackendUnavailable as exc:
            report.append(f"{name} FAILED: {exc}")
            continue
        except Exception:
            report.append(f"{name} FAILED:\n{traceback.format_exc()}")
            continue
        if name == "backend check":
            backend, passed[name] = result, True
        elif name in passed:
            passed[name] = bool(result)
    report.append("--- verdict: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in passed.items()))
    args.report.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"report written to {args.report}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
