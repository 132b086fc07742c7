"""`LLM(..., ep=, dp=, cp=)` over spawned gloo processes: greedy (and unseeded sampled) outputs equal the
single-process engine's token for token, also for ranks that get no request; EPLB re-places experts
mid-run without changing outputs and lowers the max/mean tokens per rank; a killed rank raises
RankFailed in the caller and bad rank counts raise ParallelConfigError before any process starts.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from v41_fixtures import FIXTURES

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.distributed import ParallelConfigError, RankFailed
from deepinfer_core.engine.llm import InvalidRequestError
from deepinfer_core.engine.parallel_llm import partition_requests

ENGINE = dict(accelerator="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8, parallel_timeout_s=60)
PROMPT_LENS = (5, 12, 3, 9, 7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Unseeded: each request's seed derives from its request id, which must not depend on its rank.
SAMPLED = SamplingParams(temperature=0.9, top_k=20, max_tokens=6, ignore_eos=True)


def _prompts(count: int, vocab: int = 512) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, vocab - 10, (n,), generator=gen).tolist()} for n in PROMPT_LENS[:count]]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@lru_cache(maxsize=None)
def _single_process(checkpoint: Path, num_prompts: int, vocab: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Greedy then sampled tokens, and the request ids, from a fresh single-process LLM (ids from 0)."""
    llm = LLM(str(checkpoint), **ENGINE)
    greedy = llm.generate(_prompts(num_prompts, vocab), GREEDY, use_tqdm=False)
    sampled = llm.generate(_prompts(num_prompts, vocab), SAMPLED, use_tqdm=False)
    return _tokens(greedy), _tokens(sampled), [o.request_id for o in greedy + sampled]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint: Path) -> dict[str, tuple[Path, int]]:
    """(checkpoint, vocabulary size): V4's tiny one (8 experts) and a V4.1 fixture (6 experts)."""
    return {"v4": (tiny_checkpoint, 512), "v41": (FIXTURES / "a_release_like" / "checkpoint", 160)}


# (model, options, prompts). EP + DP on V4 is also the EPLB test's setting.
CASES = {
    "v4_ep2": ("v4", dict(ep=2), 5),                # attention replicated, each MoE takes half the rows
    "v4_dp2": ("v4", dict(dp=2), 5),                # each rank its own requests and KV cache
    "v4_cp2": ("v4", dict(cp=2), 5),                # every rank the same requests, each step's rows split
    "v41_ep2_dp2_redundant": ("v41", dict(ep=2, dp=2, num_redundant_experts=2), 3),
    # 4 processes (two EP groups of 2, a rank with no request): the slowest case, under its own limit.
    "v4_ep2_dp4_three_prompts": ("v4", dict(ep=2, dp=4), 3),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CASES)
def test_outputs_match_single_process(checkpoints: dict, name: str) -> None:
    model, options, num_prompts = CASES[name]
    checkpoint, vocab = checkpoints[model]
    prompts = _prompts(num_prompts, vocab)
    llm = LLM(str(checkpoint), **ENGINE, **options)
    try:
        greedy = llm.generate(prompts, GREEDY)
        with pytest.raises(InvalidRequestError, match="request 1: the prompt is empty"):
            llm.generate([prompts[0], {"prompt_token_ids": []}], GREEDY)  # refused on every rank, nothing runs
        sampled = llm.generate(prompts, SAMPLED)  # request ids continue from the first call, as in one process
    finally:
        llm.shutdown()
    want_greedy, want_sampled, want_ids = _single_process(checkpoint, num_prompts, vocab)
    assert _tokens(greedy) == want_greedy
    assert _tokens(sampled) == want_sampled
    assert [o.request_id for o in greedy + sampled] == want_ids


def test_eplb_replaces_experts_mid_run_and_lowers_the_imbalance(tiny_checkpoint: Path) -> None:
    # Skewed: most prompts repeat one token, so the hash-routed layers send them to the same experts.
    prompts = [{"prompt_token_ids": [t] * n} for t, n in ((7, 12), (7, 9), (300, 6), (7, 10))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    steps_per_run = params.max_tokens  # one prefill step (every prompt fits the budget), then 11 decode steps
    llm = LLM(str(tiny_checkpoint), **ENGINE, ep=2, dp=2, num_redundant_experts=2, eplb_interval_steps=steps_per_run)
    try:
        # The same requests twice: the second run routes the same tokens, now under the balanced placement.
        first, second = llm.generate(prompts, params), llm.generate(prompts, params)
        records = llm.eplb_records()
    finally:
        llm.shutdown()
    want = _tokens(LLM(str(tiny_checkpoint), **ENGINE).generate(prompts, params, use_tqdm=False))
    assert _tokens(first) == want and _tokens(second) == want
    assert [r.step for r in records] == [steps_per_run, 2 * steps_per_run], records
    before, after = records[0].imbalance_before, records[1].imbalance_before
    print(f"max/mean (token, expert) pairs per EP rank, worst layer: {before:.3f} under the initial placement, "
          f"{after:.3f} after EPLB (planned {records[0].imbalance_planned:.3f})")
    assert after < before - 0.1, records


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from deepinfer_core import LLM, SamplingParams
    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
    outputs = llm.generate(json.loads(sys.argv[3]), SamplingParams(**json.loads(sys.argv[4])), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    with open(os.path.join(sys.argv[5], "rank" + os.environ["RANK"] + ".json"), "w") as out:
        json.dump(tokens, out)
""")


def test_torchrun_ranks_each_return_every_output(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """SPMD under torchrun, ep=2 dp=2 with one prompt: rank 1 has no request and joins the MoE
    collectives without tokens; both ranks return the output."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    prompts = _prompts(1)
    engine = {**ENGINE, "ep": 2, "dp": 2}
    greedy = dict(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         str(tiny_checkpoint), json.dumps(engine), json.dumps(prompts), json.dumps(greedy), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    want = _single_process(tiny_checkpoint, 1, 512)[0]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [want, want]


def test_partition_balances_prompt_tokens() -> None:
    assert partition_requests([5, 12, 3, 9, 7], 2) == [[0, 1], [2, 3, 4]]
    assert partition_requests([4], 3) == [[0], [], []]
    assert partition_requests([2, 2, 2, 2], 2) == [[0, 2], [1, 3]]


def test_a_killed_rank_raises_rank_failed_in_the_caller(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), **{**ENGINE, "parallel_timeout_s": 20, "num_kv_blocks": 256}, ep=2)
    victim = llm._workers.pool.pids[1]
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # runs well past the kill
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RankFailed, match=r"rank 1 of 2 exited with code -9"):
            llm.generate(_prompts(4), long)
    finally:
        killer.cancel()
    assert time.monotonic() - start < 20
    with pytest.raises(RankFailed, match="stopped"):
        llm.generate(_prompts(1), GREEDY)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("options, message", [
    (dict(ep=3), r"8 \+ num_redundant_experts=0 = 8 expert slots cannot be split evenly over ep=3"),
    (dict(ep=4, dp=2), r"ep=4 must divide dp=2"),
    (dict(ep=2, cp=2), r"context parallelism does not combine"),
    (dict(dp=2, eplb_interval_steps=4), r"need ep > 1"),
])
def test_bad_rank_counts_fail_before_spawning(tiny_checkpoint: Path, options: dict, message: str) -> None:
    with pytest.raises(ParallelConfigError, match=message):
        LLM(str(tiny_checkpoint), **ENGINE, **options)
    assert not multiprocessing.active_children()


def test_one_rank_takes_the_single_process_path(tiny_checkpoint: Path) -> None:
    """ep = dp = cp = 1 (the default): no rank runtime, no spawned process, no collective, and the MoE
    layers are the model's own, not the expert-parallel wrapper; so one device pays nothing for the
    parallel code."""
    from deepinfer_core.distributed import ExpertParallelMoE

    llm = LLM(str(tiny_checkpoint), **ENGINE)
    assert llm._rank is None and llm._workers is None
    assert not any(isinstance(m, ExpertParallelMoE) for m in llm.model.modules())
    assert not torch.distributed.is_initialized()
