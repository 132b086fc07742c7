"""Issue 8 check: is a request's output independent of the batch it runs in?

First the backend's ops in batch-invariant mode run the conformance cases (within tolerance of the
reference). Then, for each checkpoint (the tiny one, and a V4-Flash-width slice with --bench-layers
layers and --bench-experts routed experts, random weights as scripts/bench_model.py makes them) and
each mode (batch-invariant, default):
- a greedy probe request runs alone (sync scheduling, whole-prompt prefill): its logits at every step
  are the baseline;
- it runs again inside batches of 2..128 requests (random lengths, the probe at a random position),
  for each scheduling (async on/off) and chunk size (the step token budget: 256 / 1024 / whole); each
  run's logits are compared bitwise with the baseline;
- a seeded sampled request draws 1000 tokens in 3 runs with batches of 1, 8 and 32 requests; the
  token lists must be identical.
With --throughput, prefill and decode tokens/s are measured with the mode on and off. Prints a markdown
table and rewrites --out after every row (a run cut short keeps its table). Exit status 1 when the
invariant mode differs anywhere.

    python scripts/check_batch_invariance.py --checkpoint tiny --out tiny.md                 # H200
    python scripts/check_batch_invariance.py --checkpoint bench --throughput --out flash.md  # H200
    python scripts/check_batch_invariance.py --accelerator cpu --quick --out /tmp/q.md      # minutes on a CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.tools import make_tiny_checkpoint


@dataclass
class Row:
    checkpoint: str
    mode: str
    check: str
    runs: int
    identical: int
    detail: str = ""

    def markdown(self) -> str:
        verdict = "PASS" if self.identical == self.runs else "DIFFERS"
        return (f"| {self.checkpoint} | {self.mode} | {self.check} | {self.identical}/{self.runs} | {verdict} "
                f"| {self.detail} |")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="invariance-"))
    checkpoints = {}
    if args.checkpoint in ("tiny", "both"):
        checkpoints["tiny"] = make_tiny_checkpoint(work / "tiny", dtype=torch.bfloat16)
    if args.checkpoint in ("bench", "both"):
        # --quick writes the bench slice at the tiny widths: the same writer and loader, in seconds.
        name = "bench-slice (tiny widths)" if args.quick else f"flash-width ({args.bench_layers} layers)"
        checkpoints[name] = _bench_slice_checkpoint(work / "slice", args)
    rows: list[Row] = [_conformance(args)]
    speeds: list[str] = []

    def report(row: Row) -> None:
        """Print the row and rewrite --out, so a run cut short still leaves its table."""
        rows.append(row)
        print(row.markdown(), flush=True)
        _write_table(args, rows, speeds)

    print(rows[0].markdown(), flush=True)
    modes = {"both": (True, False), "invariant": (True,), "default": (False,)}[args.modes]
    for name, path in checkpoints.items():
        if args.throughput:  # first, so a run cut short by a time limit still has the cost
            speeds += _throughput(name, path, args)
            _write_table(args, rows, speeds)
        for invariant in modes:
            mode = "invariant" if invariant else "default"
            _logit_checks(name, mode, path, invariant, args, report)
            report(_sampling_check(name, mode, path, invariant, args))
    print(_write_table(args, rows, speeds))
    invariant_ok = all(r.identical == r.runs for r in rows if r.mode == "invariant")
    default_differs = any(r.identical < r.runs for r in rows if r.mode == "default")
    print(f"invariant mode bitwise equal everywhere: {invariant_ok}; default mode differs somewhere: {default_differs}")
    return 0 if invariant_ok else 1


def _write_table(args: argparse.Namespace, rows: list[Row], speeds: list[str]) -> str:
    table = ["| checkpoint | mode | check | passed (bitwise equal / within tolerance) | verdict | detail |",
             "|---|---|---|---|---|---|", *(row.markdown() for row in rows)]
    if speeds:
        table += ["", "| checkpoint | mode | prefill tok/s | decode tok/s |", "|---|---|---|---|", *speeds]
    text = f"accelerator {args.accelerator}, dtype {args.dtype}\n\n" + "\n".join(table) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    return text


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint only, small batches and lengths")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--throughput", action="store_true", help="also measure prefill/decode tokens/s on vs off")
    parser.add_argument("--checkpoint", default="both", choices=("tiny", "bench", "both"),
                        help="the tiny checkpoint, the Flash-width bench slice, or both (split long GPU runs)")
    parser.add_argument("--modes", default="both", choices=("both", "invariant", "default"),
                        help="which modes run the bitwise checks (the default mode shows the check can fail)")
    parser.add_argument("--bench-layers", type=int, default=3, help="layers of the Flash-width checkpoint")
    parser.add_argument("--bench-experts", type=int, default=32, help="routed experts of the Flash-width checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the cpu accelerator")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.chunks, args.prompt_len = [2, 5], [16, None], 40
        args.decode_steps, args.sample_tokens = 6, 24
        args.max_other_len, args.max_seqs, args.max_model_len = 48, 40, 1024
    else:
        args.batch_sizes, args.chunks, args.prompt_len, args.decode_steps, args.sample_tokens = (
            [2, 16, 128], [256, 1024, None], 700, 24, 1000)
        args.max_other_len, args.max_seqs, args.max_model_len = 600, 160, 4096
    return args


def _llm(path: Path, invariant: bool, args: argparse.Namespace, *, async_on: bool, chunk: int | None) -> LLM:
    gc.collect()  # the previous engine's KV pool goes before this one sizes its own
    if args.accelerator == "nvidia":
        torch.cuda.empty_cache()
    budget = chunk or 16384
    return LLM(str(path), accelerator=args.accelerator, dtype=args.dtype, batch_invariant=invariant,
               async_scheduling=async_on, max_num_batched_tokens=budget, max_num_seqs=args.max_seqs,
               max_model_len=args.max_model_len, seed=args.seed, kv_cache_memory_fraction=0.3)


class _LogitRecorder:
    """Wraps the runner's launch_forward and keeps the probe's logits row of every step."""

    def __init__(self, llm: LLM, probe_prompt: list[int]) -> None:
        self.prompt, self.steps = tuple(probe_prompt), []
        runner = llm.engine.runner
        launch = runner.launch_forward

        def recording(step, previous):
            forward = launch(step, previous)
            for row, seq in enumerate(step.sampling_seqs):
                if tuple(seq.token_ids[:seq.num_prompt_tokens]) == self.prompt:
                    self.steps.append(forward.logits[row].clone())
            return forward

        runner.launch_forward = recording

    def host(self) -> list[torch.Tensor]:
        return [s.float().cpu() for s in self.steps]


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]


def _logit_checks(name: str, mode: str, path: Path, invariant: bool, args: argparse.Namespace, report) -> None:
    rng = random.Random(args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)
    llm = _llm(path, invariant, args, async_on=False, chunk=None)
    vocab = llm.model_config.vocab_size
    probe = _random_prompt(rng, args.prompt_len, vocab)
    recorder = _LogitRecorder(llm, probe)
    llm.generate([{"prompt_token_ids": probe}], greedy, use_tqdm=False)
    baseline = recorder.host()
    del llm
    for async_on in (False, True):
        for chunk in args.chunks:
            llm = _llm(path, invariant, args, async_on=async_on, chunk=chunk)
            identical, worst = 0, 0.0
            for size in args.batch_sizes:
                recorder = _LogitRecorder(llm, probe)
                others = [
                    (_random_prompt(rng, rng.randint(1, args.max_other_len), vocab),
                     rng.randint(1, 2 * args.decode_steps))
                    for _ in range(size - 1)
                ]
                prompts = [{"prompt_token_ids": p} for p, _ in others]
                params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in others]
                at = rng.randint(0, len(prompts))
                prompts.insert(at, {"prompt_token_ids": probe})
                params.insert(at, greedy)
                llm.generate(prompts, params, use_tqdm=False)
                got = recorder.host()
                same = len(got) == len(baseline) and all(torch.equal(a, b) for a, b in zip(got, baseline))
                identical += same
                if not same and len(got) == len(baseline):
                    worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(got, baseline)))
            del llm
            chunk_name = chunk or "whole"
            report(Row(name, mode, f"probe logits, async {'on' if async_on else 'off'}, chunk {chunk_name}, "
                       f"batches {args.batch_sizes}", len(args.batch_sizes), identical,
                       f"max abs diff {worst:.3g}" if identical < len(args.batch_sizes) else ""))


def _sampling_check(name: str, mode: str, path: Path, invariant: bool, args: argparse.Namespace) -> Row:
    rng = random.Random(args.seed + 1)
    llm = _llm(path, invariant, args, async_on=True, chunk=args.chunks[0])
    vocab = llm.model_config.vocab_size
    probe = _random_prompt(rng, args.prompt_len // 2, vocab)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=args.sample_tokens, ignore_eos=True)
    runs = []
    for others in (0, 7, 31):
        prompts = [{"prompt_token_ids": _random_prompt(rng, rng.randint(1, args.max_other_len), vocab)}
                   for _ in range(others)]
        params = [SamplingParams(temperature=0.8, max_tokens=rng.randint(1, args.sample_tokens), ignore_eos=True)
                  for _ in range(others)]
        at = rng.randint(0, others)
        prompts.insert(at, {"prompt_token_ids": probe})
        params.insert(at, seeded)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(outputs[at].outputs[0].token_ids)
    same = sum(run == runs[0] for run in runs)
    first_split = next((i for i, pair in enumerate(zip(*runs)) if len(set(pair)) > 1), None)
    detail = "" if same == len(runs) else f"first differing token {first_split}"
    return Row(name, mode, f"{args.sample_tokens} seeded tokens, batches of 1/8/32", len(runs), same, detail)


def _conformance(args: argparse.Namespace) -> Row:
    """The backend's ops in batch-invariant mode against the reference, on every conformance case."""
    from deepinfer_core.platform.conformance import run_conformance
    from deepinfer_core.platform.registry import select_backend

    backend = select_backend(args.accelerator)
    ops = backend.ops()
    ops.batch_invariant = True
    backend.ops = lambda: ops
    report = run_conformance(backend, seed=args.seed)
    failed = [f"{r.op}/{r.case}/{str(r.dtype).removeprefix('torch.')}" for r in report.results if not r.passed]
    return Row("-", "invariant", "op conformance (tolerances of op_cases.py)", len(report.results),
               len(report.results) - len(failed), ", ".join(failed))


def _throughput(name: str, path: Path, args: argparse.Namespace) -> list[str]:
    lines = []
    n_prefill, prefill_len = (4, 64) if args.quick else (16, 2048)
    n_decode, decode_len = (4, 16) if args.quick else (64, 128)
    rng = random.Random(args.seed + 2)
    for invariant in (True, False):
        llm = _llm(path, invariant, args, async_on=True, chunk=None)
        vocab = llm.model_config.vocab_size
        prompts = [{"prompt_token_ids": _random_prompt(rng, prefill_len, vocab)} for _ in range(n_prefill)]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts[:1], one, use_tqdm=False)  # warm-up: kernels compiled, pools touched
        _sync(args)
        started = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        _sync(args)
        prefill = n_prefill * prefill_len / (time.perf_counter() - started)
        short = [{"prompt_token_ids": _random_prompt(rng, 16, vocab)} for _ in range(n_decode)]
        llm.generate(short, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        _sync(args)
        started = time.perf_counter()
        llm.generate(short, SamplingParams(temperature=0.0, max_tokens=1 + decode_len, ignore_eos=True),
                     use_tqdm=False)
        _sync(args)
        total = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate(short, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        _sync(args)
        decode = n_decode * decode_len / max(total - (time.perf_counter() - started), 1e-9)
        lines.append(f"| {name} | {'invariant' if invariant else 'default'} | {prefill:.0f} | {decode:.0f} |")
        print(lines[-1], flush=True)
        del llm
    return lines


def _sync(args: argparse.Namespace) -> None:
    if args.accelerator == "nvidia":
        torch.cuda.synchronize()


def _bench_slice_checkpoint(path: Path, args: argparse.Namespace) -> Path:
    """The bench model (bench_model.flash_slice_raw: Flash widths, or its tiny widths with --quick) with
    --bench-layers layers and --bench-experts routed experts, random bf16 weights made on the device,
    saved as a checkpoint the engine loads."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_model import build_deepinfer, flash_slice_raw

    from deepinfer_core.platform.kernel_ops import KernelOps

    raw = flash_slice_raw(tiny=args.quick, weights="bf16")
    layers = args.bench_layers
    experts = min(args.bench_experts, raw["n_routed_experts"]) if args.quick else args.bench_experts
    raw.update(num_hidden_layers=layers, compress_ratios=([0, 4, 128] * layers)[:layers], n_routed_experts=experts,
               num_hash_layers=min(1, layers))
    device = torch.device("cuda" if args.accelerator == "nvidia" else "cpu")
    bench = build_deepinfer(raw, KernelOps(), device)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().clone() for name, t in bench.model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    del bench
    return path


if __name__ == "__main__":
    raise SystemExit(main())
