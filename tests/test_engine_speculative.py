"""Speculative decoding through the whole engine: `LLM(..., speculative=SpeculativeConfig(...))`.

On the tiny float32 checkpoint, a batch of mixed prompt lengths with a token budget that forces
chunked prefill and a KV pool that forces preemption. Greedy output must be token-identical to the
same engine without speculation. The checkpoint's MTP weights are random, so its drafts are almost
never accepted (this checks rejection and rollback); an oracle drafter that knows the greedy
continuation, right for a varying number of drafts per step, checks partial and full acceptance.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams, SpeculativeConfig, StructuredOutput
from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.speculative import Draft, DraftContext, Drafter

PROMPT_LENS = [1, 3, 8, 9, 17, 24, 33, 40]
NEW_TOKENS = 48
BUDGET = 16        # tokens per step: the longer prompts are prefilled in chunks
SMALL_POOL = 24    # KV blocks of 8 tokens: not enough for every sequence at once, so some are preempted
# float32 logprobs of the same position from a verification row and from a plain decode row differ
# only in summation order
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(tiny_checkpoint: Path) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(2, 200, (n,), generator=gen).tolist()} for n in PROMPT_LENS]


def make_llm(checkpoint: Path, speculative: SpeculativeConfig | None = None, async_scheduling: bool = True) -> LLM:
    return LLM(str(checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=BUDGET,
               num_kv_blocks=SMALL_POOL, async_scheduling=async_scheduling, speculative=speculative)


def greedy(max_tokens: int = NEW_TOKENS) -> list[SamplingParams]:
    # The seed does not change a greedy draw; the oracle drafter uses it to tell requests apart.
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=i, logprobs=2)
            for i in range(len(PROMPT_LENS))]


@pytest.fixture(scope="module")
def plain(tiny_checkpoint: Path, prompts) -> list:
    """The same engine without speculation: the outputs every speculative run must reproduce."""
    return make_llm(tiny_checkpoint).generate(prompts, greedy(), use_tqdm=False)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in plain]


class OracleDrafter(Drafter):
    """Drafts the known greedy continuation of the request whose seed a row carries: right for
    (output index % (k + 1)) drafts, then wrong, so every acceptance length from 0 to k occurs."""

    def __init__(self, reference: list[list[int]], k: int, vocab_size: int) -> None:
        self.reference, self.k, self.vocab_size = reference, k, vocab_size

    def propose(self, context: DraftContext, sampling: SamplingTensors, max_drafts: list[int]) -> Draft:
        rows = len(max_drafts)
        tokens = torch.full((rows, self.k), -1, dtype=torch.long)
        lengths = [min(self.k, m) for m in max_drafts]
        for i, (seed, first) in enumerate(zip(sampling.seeds.tolist(), sampling.positions.tolist())):
            right = first % (self.k + 1)
            want = self.reference[seed][first:first + lengths[i]]  # max_drafts keeps it inside the reference
            tokens[i, :len(want)] = torch.tensor(
                [t if j < right else (t + 1) % self.vocab_size for j, t in enumerate(want)], dtype=torch.long
            )
        return Draft(tokens, torch.ones(rows, self.k), torch.tensor(lengths), None)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("k,threshold", [(1, 0.0), (1, 0.6), (3, 0.0), (3, 0.6)])
def test_mtp_greedy_matches_plain_decoding(tiny_checkpoint, prompts, reference, k, threshold, async_scheduling):
    spec = SpeculativeConfig(method="mtp", num_draft_tokens=k, confidence_threshold=threshold)
    llm = make_llm(tiny_checkpoint, spec, async_scheduling)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    summary = llm.engine.stats.summary()
    assert summary["preemptions"] > 0
    assert summary["spec_draft_tokens"] == sum(o.spec_draft_tokens for o in outputs)
    assert summary["spec_accepted_tokens"] == sum(o.spec_accepted_tokens for o in outputs)
    if threshold == 0.0:  # every decode step drafts (max_tokens and the budget permitting)
        assert all(o.spec_draft_tokens > 0 for o in outputs)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_oracle_drafts_are_accepted_and_output_is_unchanged(
    tiny_checkpoint, prompts, plain, reference, async_scheduling
):
    k = 3
    llm = make_llm(tiny_checkpoint, SpeculativeConfig(num_draft_tokens=k), async_scheduling)
    llm.engine.runner.drafter = OracleDrafter(reference, k, llm.model_config.vocab_size)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.spec_accepted_tokens > 0 for o in outputs)
    for got, want in zip(outputs, plain):  # logprobs of accepted drafts come from verification rows
        for got_lp, want_lp in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert got_lp.keys() == want_lp.keys()
            assert all(abs(got_lp[t] - want_lp[t]) < LOGPROB_TOL for t in got_lp)
    stats = llm.engine.stats.speculative
    assert stats.num_accepted == sum(o.spec_accepted_tokens for o in outputs)
    # the oracle is right for 0..k drafts in turn: every draft position is sometimes accepted, and
    # a step emits well over one token on average
    assert all(a > 0 for a in stats.accepted[:k]) and stats.tokens_per_step > 1.5
    assert llm.engine.stats.num_preemptions > 0


def sampled(indices: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=100 + i)
            for i in indices]


def test_seeded_sampling_is_deterministic_across_runs_and_batches(tiny_checkpoint, prompts):
    spec = SpeculativeConfig(num_draft_tokens=3, confidence_threshold=0.0)
    llm = make_llm(tiny_checkpoint, spec)
    everyone = list(range(len(prompts)))
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled(everyone), use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled(everyone), use_tqdm=False)]
    assert first == again
    some = everyone[::-3]  # fewer requests, in another order, at other batch positions and slots
    other = make_llm(tiny_checkpoint, spec, async_scheduling=False)
    alone = other.generate([prompts[i] for i in some], sampled(some), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [first[i] for i in some]
    assert len({tuple(t) for t in first}) == len(first)  # sampled, not collapsed to one sequence


def test_structured_request_in_a_speculative_batch_validates(tiny_checkpoint, prompts, reference):
    pattern = "[a-z]{3,6}-[0-9]{2}"
    llm = make_llm(tiny_checkpoint, SpeculativeConfig(num_draft_tokens=3))
    params = greedy()
    params[2] = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                               structured_output=StructuredOutput(regex=pattern))
    params[5] = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS,
                               structured_output=StructuredOutput(regex=pattern))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i in (2, 5):
        assert re.fullmatch(pattern, outputs[i].outputs[0].text), outputs[i].outputs[0].text
        assert outputs[i].outputs[0].finish_reason == "stop"
    for i in (0, 1, 3, 4, 6, 7):
        assert outputs[i].outputs[0].token_ids == reference[i]


def test_scheduler_verifies_drafts_within_the_budget() -> None:
    """A decode holding drafts is scheduled with them (budget permitting), counting only its last
    token as computed; accepted drafts are added as computed once the engine appends them."""
    from deepinfer_core.config import SchedulerConfig
    from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
    from deepinfer_core.engine.kv_cache import KVCacheManager, KVPoolPlan
    from deepinfer_core.engine.scheduler import Scheduler
    from deepinfer_core.engine.sequence import Sequence

    kv = KVCacheManager(KVPoolPlan(num_blocks=16, block_size=4, num_slots=2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=3), kv)
    seq = Sequence(seq_id=0, request_id=0, index=0, token_ids=[5, 6, 7], num_prompt_tokens=3, max_num_tokens=20,
                   params=SamplingParams(max_tokens=17), seed=0,
                   detokenizer=IncrementalDetokenizer(None, [5, 6, 7], []))
    scheduler.add(seq)
    assert [(i.start, i.num_tokens, i.draft) for i in scheduler.schedule()] == [(0, 3, [])]
    seq.resolve_pending(8)
    seq.set_draft([9, 10, 11], None)
    (item,) = scheduler.schedule()
    assert (item.start, item.num_tokens, item.draft) == (3, 3, [9, 10])  # the budget cut the last draft
    assert seq.num_computed_tokens == 4 and len(seq.block_table) == kv.blocks_for(6)
    seq.resolve_pending(9)      # draft 1 accepted, then the target's own token
    seq.append_accepted(12)
    assert seq.num_computed_tokens == 5 and seq.num_uncomputed_tokens == 1


# Issue scale: 16 prompts x 200 new tokens, k = 1, 2, 4, several thresholds, async on and off.
LONG_PROMPT_LENS = [1, 2, 3, 5, 8, 9, 12, 16, 17, 20, 24, 29, 33, 37, 40, 47]
LONG_NEW_TOKENS = 200


def _long_llm(checkpoint: Path, speculative: SpeculativeConfig | None, async_scheduling: bool) -> LLM:
    return LLM(str(checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
               num_kv_blocks=2 * len(LONG_PROMPT_LENS) * 32, async_scheduling=async_scheduling, speculative=speculative)


def _long_greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=LONG_NEW_TOKENS, ignore_eos=True, seed=i)
            for i in range(len(LONG_PROMPT_LENS))]


@pytest.fixture(scope="module")
def long_prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(9)
    return [{"prompt_token_ids": torch.randint(2, 200, (n,), generator=gen).tolist()} for n in LONG_PROMPT_LENS]


@pytest.fixture(scope="module")
def long_reference(tiny_checkpoint: Path, long_prompts) -> list[list[int]]:
    outputs = _long_llm(tiny_checkpoint, None, True).generate(long_prompts, _long_greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_issue_scale_greedy_identity(tiny_checkpoint, long_prompts, long_reference, k, async_scheduling):
    """The MTP drafter at a confidence threshold (0 with async, 0.5 without: both kinds of stop), then
    the oracle drafter (partial acceptance): both token-identical to plain decoding."""
    threshold = 0.0 if async_scheduling else 0.5
    spec = SpeculativeConfig(method="mtp", num_draft_tokens=k, confidence_threshold=threshold)
    llm = _long_llm(tiny_checkpoint, spec, async_scheduling)
    outputs = llm.generate(long_prompts, _long_greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == long_reference

    llm = _long_llm(tiny_checkpoint, spec, async_scheduling)
    llm.engine.runner.drafter = OracleDrafter(long_reference, k, llm.model_config.vocab_size)
    outputs = llm.generate(long_prompts, _long_greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == long_reference
    # right for (output index % (k+1)) drafts: each step then starts where the oracle is right for some
    # drafts (which lengths recur depends on k), so drafts are accepted and steps emit over one token
    stats = llm.engine.stats.speculative
    assert stats.accepted[0] > 0 and stats.tokens_per_step > 1.2
