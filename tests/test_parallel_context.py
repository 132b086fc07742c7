"""Context parallelism at the model level on gloo processes: every rank runs the same steps on its own
full cache with each step's rows shared out (apply_context_parallel), and its logits, caches and
greedy tokens equal the single-process model's.

One run per world size (2 and 4 ranks) plays two scenarios, and the tests below check them:
- a long prompt prefilled in chunks longer than the sliding window, across compression windows, then
  decoded (one row a step: replicated);
- a mixed batch: three prompts prefilled together (9 rows: a prompt is cut between ranks, and some
  ranks hold no row of a prompt), then decode rows mixed with a fourth prompt's two chunks, then 16
  greedy decode steps of all four sequences.
Steps with fewer rows than ranks run replicated; shares are never empty.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_cache, build_forward_batch
from parallel_fixtures import relative_error
from v41_fixtures import FIXTURES

from deepinfer_core.distributed import ParallelConfigError, apply_context_parallel, spawn
from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache, DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM, parse_deepseek_v41_config
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.reference.backend import CpuBackend
from deepinfer_core.weights.loader import load_model_weights

# Every row goes through the single process's arithmetic in the same order (attention reads the same
# keys); what differs is CPU rounding that depends on how many rows an op gets: the single-process
# model itself moves a logit by 2e-5 (logits up to 18) when a prompt's first 8 rows run alone instead
# of within 15. So not elementwise: relative error over each tensor, measured ~1.5e-6 on logits.
TOLERANCE = 1e-5
CPU = torch.device("cpu")
LONG_PROMPT, CHUNKS, LONG_DECODE = 37, (15, 15, 7), 4
MIXED_PROMPTS, FOURTH_CHUNKS, GREEDY_STEPS = (5, 2, 2), (10, 10), 16


def _build(path: Path) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(load_model_config(path), KernelOps(), torch.float32, CPU)
    load_model_weights(model, path)
    return model


def _blocks(seq: int) -> list[int]:
    return list(range(16 * seq, 16 * seq + 16))


def _step(model: DeepseekV4ForCausalLM, cache: DeepseekV4Cache, seqs: list, record: dict) -> torch.Tensor:
    batch = build_forward_batch(seqs)
    out = model(batch, cache)
    logits = model.compute_logits(out.hidden)
    record["logits"].append(logits)
    record["steps"].append(batch.num_tokens)
    return logits[batch.query_start_loc[1:].long() - 1].argmax(dim=-1)


def _scenarios(model: DeepseekV4ForCausalLM) -> dict:
    """Both scenarios on fresh caches; every token fed back is this model's own greedy choice."""
    config = model.config
    record = {"logits": [], "steps": [], "mtp": None, "tokens": None, "caches": None}
    gen = torch.Generator().manual_seed(7)

    long_cache = build_cache(config, num_slots=4)
    prompt = torch.randint(0, config.vocab_size, (LONG_PROMPT,), generator=gen)
    context = 0
    for chunk in CHUNKS:
        ids = prompt[context : context + chunk]
        if context == 0:
            batch = build_forward_batch([(ids, 0, 2, _blocks(2))])
            out = model(batch, long_cache)
            record["logits"].append(model.compute_logits(out.hidden))
            record["steps"].append(batch.num_tokens)
            # The MTP block reads the gathered streams (and runs replicated).
            record["mtp"] = model.mtp_forward(out.streams, torch.roll(batch.input_ids, -1), batch, long_cache).logits
        else:
            token = _step(model, long_cache, [(ids, context, 2, _blocks(2))], record)
        context += chunk
    for _ in range(LONG_DECODE):
        token = _step(model, long_cache, [(token, context, 2, _blocks(2))], record)
        context += 1

    cache = build_cache(config, num_slots=4)
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in MIXED_PROMPTS]
    fourth = torch.randint(0, config.vocab_size, (sum(FOURTH_CHUNKS),), generator=gen)
    picked = _step(model, cache, [(t, 0, i, _blocks(i)) for i, t in enumerate(tokens)], record)
    tokens = [torch.cat([t, p[None]]) for t, p in zip(tokens, picked)]
    done = 0
    for chunk in FOURTH_CHUNKS:
        seqs = [(t[-1:], len(t) - 1, i, _blocks(i)) for i, t in enumerate(tokens)]
        seqs.append((fourth[done : done + chunk], done, 3, _blocks(3)))
        picked = _step(model, cache, seqs, record)
        tokens = [torch.cat([t, p[None]]) for t, p in zip(tokens, picked)]
        done += chunk
    tokens.append(torch.cat([fourth, picked[-1:]]))
    for _ in range(GREEDY_STEPS):
        seqs = [(t[-1:], len(t) - 1, i, _blocks(i)) for i, t in enumerate(tokens)]
        picked = _step(model, cache, seqs, record)
        tokens = [torch.cat([t, p[None]]) for t, p in zip(tokens, picked)]

    record["tokens"] = tokens
    record["caches"] = [_cache_tensors(long_cache), _cache_tensors(cache)]
    return record


def _cache_tensors(cache: DeepseekV4Cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        out.append(layer.window)
        for state in (layer.compressor, layer.indexer):
            if state is not None:
                out.extend([state.state_kv, state.state_gate, state.entries])
    return out


def _context_parallel_rank(rank: int, world: int, path: str) -> dict:
    model = _build(Path(path))
    apply_context_parallel(model, CpuBackend().communicator(None))
    shares = []
    begin = model.step_rows.begin

    def recording_begin(batch):
        rows = begin(batch)
        shares.append(rows.num_tokens)
        return rows

    model.step_rows.begin = recording_begin
    record = _scenarios(model)
    record["shares"] = shares
    # numpy crosses the result queue by value; a tensor would point into this exiting process's memory.
    return _map_tensors(record, lambda t: t.numpy())


def _map_tensors(value, fn):
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return fn(value) if isinstance(value, (torch.Tensor, np.ndarray)) else value


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> dict:
    return _scenarios(_build(tiny_checkpoint))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"cp{w}")
def ranks(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> list[dict]:
    world = request.param
    results = spawn(_context_parallel_rank, world, CpuBackend(), args=(str(tiny_checkpoint),), timeout_s=120)
    return [_map_tensors(r, torch.from_numpy) for r in results]


def test_rows_are_shared_out(ranks: list[dict], reference: dict) -> None:
    world = len(ranks)
    for step, total in enumerate(reference["steps"]):
        shares = [r["shares"][step] for r in ranks]
        if total < world:
            assert shares == [total] * world, (step, shares)
        else:
            base, extra = divmod(total, world)
            assert shares == [base + (r < extra) for r in range(world)], (step, shares)
    mixed_prefill = len(CHUNKS) + LONG_DECODE
    # The three prompts' 9 rows: the first prompt is cut between ranks, and some ranks hold none of it.
    assert [r["shares"][mixed_prefill] for r in ranks] == {2: [5, 4], 4: [3, 2, 2, 2]}[world]
    # The long prompt's decode steps have one row: every rank runs it (replicated, no collective).
    assert [r["shares"][len(CHUNKS)] for r in ranks] == [1] * world


def test_logits_and_caches_match_single_process(ranks: list[dict], reference: dict) -> None:
    for rank, got in enumerate(ranks):
        worst = max(relative_error(g, w) for g, w in zip(got["logits"], reference["logits"]))
        assert len(got["logits"]) == len(reference["logits"])
        assert worst <= TOLERANCE, (rank, worst)
        assert relative_error(got["mtp"], reference["mtp"]) <= TOLERANCE, rank
        for scenario, (cp_cache, want_cache) in enumerate(zip(got["caches"], reference["caches"])):
            for i, (g, w) in enumerate(zip(cp_cache, want_cache)):
                assert relative_error(g, w) <= TOLERANCE, (rank, scenario, i)
        # Every rank returns the gathered rows: identical, bit for bit.
        for g, w in zip(got["logits"], ranks[0]["logits"]):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_greedy_tokens_match_single_process(ranks: list[dict], reference: dict) -> None:
    for got in ranks:
        assert len(got["tokens"]) == len(reference["tokens"]) == len(MIXED_PROMPTS) + 1
        for g, w in zip(got["tokens"], reference["tokens"]):
            assert g.tolist() == w.tolist()


def test_v41_model_is_refused() -> None:
    ckpt = FIXTURES / "b_mixed_ratios" / "checkpoint"
    config = parse_deepseek_v41_config(json.loads((ckpt / "config.json").read_text()))
    model = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, CPU)
    # Refused before any collective: no process group needed.
    with pytest.raises(ParallelConfigError, match="DeepseekV41ForCausalLM.*cp=1"):
        apply_context_parallel(model, comm=None)
