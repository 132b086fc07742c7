"""Speculative decoding against plain decoding on the benchmark model (`bench_decode.py --speculative`).

Random weights make a real MTP layer accept nothing, so the drafts come from an oracle whose acceptance
is chosen: it knows the target's own greedy continuation (computed first by plain greedy decode steps
of the same sequences from the same cache state) and proposes it, replacing each draft by a wrong
token with probability 1 - a, independently. A greedy verifier then accepts the leading correct
drafts: expected emitted tokens per step 1 + a + ... + a^k.

Per batch size and a: plain step ms (one token per sequence), verification step ms (`verify_step` on
k + 1 tokens per sequence, snapshot/restore of the rings included), emitted tokens per sequence-step
measured over the loop, and the speedup in emitted tokens/s two ways:
  oracle drafts: plain_ms * tokens_per_step / verify_ms (drafting costs nothing);
  MTP draft cost: plain_ms * tokens_per_step / (verify_ms + mtp_ms), mtp_ms the measured time of the
  model's real MTP layer drafting k tokens (`MtpDrafter.propose`) on the same batch; its tokens are discarded.
The speculative loop's output must equal plain greedy decoding token for token, except where plain
greedy's top-2 logits are a near-tie that bf16 rounding of a (k+1)-token step may flip: any other
difference is an error (raised on the CPU; counted in the table on a GPU, so one run gives all rows).
"""

from __future__ import annotations

import json
import random
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_model import build_deepinfer, flash_slice_raw, random_cache, step_batch
from kernel_bench_common import cell, finish_plot, new_plot, time_ms

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.speculative import Draft, MtpDrafter, SpeculativeConfig, verify_step

__all__ = ["run_speculative"]

FILES = ("spec_decode.txt", "spec_decode.json", "spec_decode.png")


def run_speculative(tiny, weights, batches, context, k, acceptances, steps, min_samples, rep_ms, device, ops, out: Path) -> None:
    raw = {**flash_slice_raw(tiny, weights), "num_nextn_predict_layers": 1}
    # float32 on the CPU: 1-token and (k+1)-token steps then agree to ~1e-6, so greedy identity is exact
    # (in bf16 their rounding differs and accumulates through the cache, flipping argmaxes of close logits)
    bench = build_deepinfer(raw, ops, device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    rows = []
    for size in batches:
        try:
            size_steps = max(steps, -(-min_samples // size))
            rows += _batch_rows(bench, size, context, k, acceptances, size_steps, rep_ms, device, strict=device.type == "cpu")
        except Exception as err:
            traceback.print_exc()
            rows.append({"batch": size, "k": k, "error": f"{type(err).__name__}: {err}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _report(rows, f"{weights} weights, {str(bench.model.embed.weight.dtype).removeprefix('torch.')} activations", context, out)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(rows)} speculative rows failed (see the error column of {out / FILES[0]})")


class _Run:
    """Fixed block tables for `size` sequences decoding from `context`, room for `room` more positions."""

    def __init__(self, bench, size: int, context: int, room: int, device: torch.device) -> None:
        self.model, self.config, self.device = bench.model, bench.config, device
        self.size, self.context = size, context
        self.block_size = 2 * max(self.config.compress_ratios)
        self.layout = step_batch([room] * size, [context] * size, self.block_size, device)
        self.start = torch.randint(0, self.config.vocab_size, (size,), generator=torch.Generator().manual_seed(5)).tolist()
        self.sampling = SamplingTensors(
            temperature=torch.zeros(size, device=device), seeds=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device), top_k=None, top_p=None, min_p=None,
            all_greedy=True,
        )

    def fresh_cache(self):
        """The same random context state every call (random_cache is seeded)."""
        return random_cache(self.config, self.layout, self.block_size, self.device, self.model.embed.weight.dtype)

    def batch(self, rows: list[list[int]], emitted: list[int]) -> ForwardBatch:
        """Sequence i's `rows[i]` tokens at positions context + emitted[i] onwards."""
        lens = [len(r) for r in rows]
        ctx = [self.context + n for n in emitted]
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        return ForwardBatch(
            input_ids=torch.tensor([t for r in rows for t in r], dtype=torch.long).to(self.device),
            positions=torch.cat([torch.arange(c, c + q) for q, c in zip(lens, ctx)]).to(self.device),
            query_start_loc=starts.to(self.device),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=self.device),
            slot_ids=torch.arange(self.size, dtype=torch.int32, device=self.device),
            block_tables=self.layout.block_tables,
            logits_indices=(starts[1:] - 1).long().to(self.device),
            query_lens_cpu=lens, context_lens_cpu=ctx, slot_ids_cpu=list(range(self.size)),
            block_tables_cpu=self.layout.block_tables_cpu,
        )

    def plain_logits(self, cache, last: list[int], emitted: list[int]) -> torch.Tensor:
        batch = self.batch([[t] for t in last], emitted)
        return self.model.compute_logits(self.model(batch, cache).hidden[batch.logits_indices])


def _batch_rows(bench, size, context, k, acceptances, steps, rep_ms, device, strict: bool) -> list[dict]:
    reference_len = steps * (k + 1) + k  # the oracle drafts up to k past the furthest emitted token
    run = _Run(bench, size, context, reference_len + k + 1, device)
    cache = run.fresh_cache()
    plain_ms = time_ms(lambda: run.plain_logits(cache, run.start, [0] * size).argmax(-1), device, rep_ms=rep_ms)
    reference = _greedy_reference(run, run.fresh_cache(), reference_len)
    drafter = MtpDrafter(run.model, cache, SpeculativeConfig(num_draft_tokens=k))
    rows = []
    for a in acceptances:
        row = {"batch": size, "context": context, "k": k, "a": a, "steps": steps, "plain_ms": plain_ms}
        try:
            row.update(_speculative(run, run.fresh_cache(), drafter, reference, a, k, steps, rep_ms, strict))
            row.update(expected_tokens_per_step=sum(a**j for j in range(k + 1)),
                       speedup_oracle=plain_ms * row["tokens_per_step"] / row["spec_ms"],
                       speedup_mtp=None if row["mtp_draft_ms"] is None
                       else plain_ms * row["tokens_per_step"] / (row["spec_ms"] + row["mtp_draft_ms"]))
        except Exception as err:
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        print(row, flush=True)
    return rows


@dataclass(slots=True)
class _Reference:
    tokens: list[list[int]]      # [S][L] plain greedy continuation after the start token
    gaps: list[list[float]]      # [S][L] top-2 logit gap; within TIE_GAP rounding may flip the argmax


# Largest top-2 logit gap that rounding may flip. bf16: a (k+1)-token step's logits differ from the 1-token
# step's by ~0.1 already at the first step (Triton interpreter) and the difference accumulates in the cache.
TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.5}


def _greedy_reference(run: _Run, cache, length: int) -> _Reference:
    """Plain greedy decoding from the start tokens, one step per token."""
    tokens, gaps = [[] for _ in range(run.size)], [[] for _ in range(run.size)]
    last = run.start
    for n in range(length):
        top = run.plain_logits(cache, last, [n] * run.size).topk(2, dim=-1)
        gap = (top.values[:, 0] - top.values[:, 1]).tolist()
        last = top.indices[:, 0].tolist()
        for seq, seq_gaps, token, g in zip(tokens, gaps, last, gap):
            seq.append(token)
            seq_gaps.append(g)
    return _Reference(tokens, gaps)


def _oracle_draft(run: _Run, reference: _Reference, emitted: list[int], a: float, k: int, rng: random.Random) -> Draft:
    """The reference continuation after each sequence's emitted tokens, each draft wrong w.p. 1 - a."""
    vocab = run.config.vocab_size
    tokens = []
    for seq, n in zip(reference.tokens, emitted):
        tokens.append([t if rng.random() < a else (t + rng.randrange(1, vocab)) % vocab for t in seq[n:n + k]])
    device = run.device
    return Draft(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        confidences=torch.ones((run.size, k), dtype=torch.float32, device=device),
        lengths=torch.full((run.size,), k, dtype=torch.long, device=device),
        probs=None,
    )


def _speculative(run: _Run, cache, drafter: MtpDrafter, reference: _Reference, a, k, steps, rep_ms, strict: bool) -> dict:
    """`steps` verification steps with oracle drafts, checked against plain greedy; then the timings.

    A sequence whose output leaves plain greedy's at a near-tie (bf16 rounding) has diverged
    legitimately: from then on the oracle's drafts are wrong for it, so its later steps are not counted
    in tokens/step. Leaving it anywhere else is a bug (raised on the CPU, counted on a GPU)."""
    rng = random.Random(1000 + int(a * 100))
    emitted_tokens = [[] for _ in range(run.size)]
    live = [True] * run.size
    counted_steps = counted_tokens = tie_flips = 0
    wrong = []
    first = None
    for _ in range(steps):
        emitted = [len(e) for e in emitted_tokens]
        last = [e[-1] if e else s for e, s in zip(emitted_tokens, run.start)]
        draft = _oracle_draft(run, reference, emitted, a, k, rng)
        batch = run.batch([[t, *d] for t, d in zip(last, draft.tokens.tolist())], emitted)
        sampling = _at(run.sampling, emitted, run.device)
        verification, context = verify_step(run.model, cache, batch, draft, sampling)
        first = first or (batch, draft, sampling, context)
        for i, (row, n) in enumerate(zip(verification.tokens.tolist(), verification.num_emitted.tolist())):
            begin = len(emitted_tokens[i])
            emitted_tokens[i] += row[:n]
            if not live[i]:
                continue
            diverged = [j for j in range(begin, begin + n) if emitted_tokens[i][j] != reference.tokens[i][j]]
            if not diverged:
                counted_steps, counted_tokens = counted_steps + 1, counted_tokens + n
                continue
            live[i], at = False, diverged[0]
            if reference.gaps[i][at] <= TIE_GAP[run.model.embed.weight.dtype]:
                tie_flips += 1
            else:
                wrong.append(f"sequence {i} token {at}: {emitted_tokens[i][at]} not {reference.tokens[i][at]} "
                             f"(plain top-2 logit gap {reference.gaps[i][at]:.4f})")
    if strict and wrong:
        raise AssertionError(f"speculative greedy output left plain greedy's away from a near-tie: {'; '.join(wrong)}")
    # timed at the first step's state (context = the plain step's); re-verifying restores the rings each time
    batch, draft, sampling, context = first
    spec_ms = time_ms(lambda: verify_step(run.model, cache, batch, draft, sampling), run.device, rep_ms=rep_ms)
    try:  # the oracle rows stand on their own if the MTP layer cannot be timed
        mtp_ms = time_ms(lambda: drafter.propose(context, sampling, [k] * run.size), run.device, rep_ms=rep_ms)
    except Exception as err:
        traceback.print_exc()
        mtp_ms = None
        print(f"MTP draft not timed: {type(err).__name__}: {err}", flush=True)
    return {"spec_ms": spec_ms, "mtp_draft_ms": mtp_ms, "tokens_per_step": counted_tokens / max(counted_steps, 1),
            "counted_sequence_steps": counted_steps, "diverged_at_near_tie": tie_flips, "diverged_elsewhere": len(wrong)}


def _at(sampling: SamplingTensors, emitted: list[int], device) -> SamplingTensors:
    positions = torch.tensor(emitted, dtype=torch.long, device=device)
    return SamplingTensors(sampling.temperature, sampling.seeds, positions, None, None, None, True)


def _report(rows, weights, context, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"speculative decoding, V4-Flash 4-layer slice, {weights}, random-state context {context}, greedy.",
        "Drafter: ORACLE with controlled acceptance (random weights make a real MTP accept nothing): it proposes",
        "the target's own plain-greedy continuation, each draft replaced by a wrong token w.p. 1 - a.",
        "speedup = emitted tokens/s vs plain decode: oracle = draft cost 0; mtp = + measured MtpDrafter.propose time",
        "(k drafts of the model's real MTP layer on the same batch, tokens discarded). tok/step = emitted per sequence-step",
        "(samples = sequence-steps counted); expected = 1 + a + ... + a^k.",
        (f"{'batch':>6}{'a':>5}{'k':>3}{'plain_ms/tok':>13}{'spec_ms/step':>13}{'mtp_ms':>9}{'tok/step':>9}"
         f"{'samples':>8}{'expected':>9}{'x_oracle':>9}{'x_mtp':>7}{'ties':>5}{'wrong':>6}  error"),
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>6}{cell(r.get('a'), '.2f'):>5}{r['k']:>3}{cell(r.get('plain_ms'), '.3f'):>13}"
            f"{cell(r.get('spec_ms'), '.3f'):>13}{cell(r.get('mtp_draft_ms'), '.3f'):>9}{cell(r.get('tokens_per_step'), '.3f'):>9}"
            f"{cell(r.get('counted_sequence_steps'), 'd'):>8}{cell(r.get('expected_tokens_per_step'), '.3f'):>9}{cell(r.get('speedup_oracle'), '.2f'):>9}"
            f"{cell(r.get('speedup_mtp'), '.2f'):>7}{cell(r.get('diverged_at_near_tie'), 'd'):>5}{cell(r.get('diverged_elsewhere'), 'd'):>6}"
            f"  {r.get('error', '')[:80]}"
        )
    lines += ["plain_ms/tok: a plain step emits one token per sequence. tok/step: over sequence-steps before a sequence left",
              "plain greedy's output; ties: sequences that left it at a near-tie (top-2 logit gap <= TIE_GAP: rounding),",
              "wrong: sequences that left it elsewhere (a bug)."]
    table = "\n".join(lines)
    (out / FILES[0]).write_text(table + "\n")
    (out / FILES[1]).write_text(json.dumps({"numerics": weights, "context": context, "drafter": "oracle, controlled acceptance",
                                            "rows": rows}, indent=1))
    _plot(rows, out / FILES[2])
    print(table)


def _plot(rows, path: Path) -> None:
    plot = new_plot()
    if plot is None:
        return
    fig, ax = plot
    for size in sorted({r["batch"] for r in rows}):
        pts = sorted((r["a"], r["speedup_oracle"], r["speedup_mtp"]) for r in rows if r["batch"] == size and "speedup_oracle" in r)
        if pts:
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {size}, oracle drafts (cost 0)")
        if pts and None not in {p[2] for p in pts}:
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", ls="--", color=line.get_color(),
                    label=f"batch {size}, + MTP draft cost")
    ax.axhline(1.0, color="k", lw=0.8)
    finish_plot(fig, ax, path, "per-draft acceptance probability a (oracle drafter)",
                "speedup in emitted tokens/s vs plain decode")
