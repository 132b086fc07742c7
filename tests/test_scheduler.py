"""Scheduler and KV accounting without a model: budgets, chunking, preemption, the pending protocol."""

from __future__ import annotations

import random

import pytest

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.kv_cache import KVCacheManager, KVPoolPlan, KVPoolTooSmallError, plan_kv_pool
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.sequence import PENDING, Sequence, SequenceStatus


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    prompt = list(range(10, 10 + prompt_len))
    return Sequence(
        seq_id=seq_id, request_id=seq_id, index=0, token_ids=list(prompt), num_prompt_tokens=prompt_len,
        max_num_tokens=prompt_len + max_tokens, params=SamplingParams(max_tokens=max_tokens), seed=seq_id,
        detokenizer=IncrementalDetokenizer(None, prompt, []),
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(KVPoolPlan(num_blocks=num_blocks, block_size=block_size, num_slots=max_seqs))
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)


def resolve(step, token: int = 3) -> None:
    for item in step:
        if item.samples:
            item.seq.resolve_pending(token)


def test_chunked_prefill_respects_the_budget_and_covers_the_prompt() -> None:
    sched = make_scheduler(budget=5)
    seq = make_seq(0, 12)
    sched.add(seq)
    chunks = [[(i.start, i.num_tokens, i.samples) for i in sched.schedule()] for _ in range(3)]
    assert chunks == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    assert seq.token_ids[-1] == PENDING and seq.num_pending == 1


def test_mixed_step_serves_decodes_before_new_prefills() -> None:
    sched = make_scheduler(budget=6)
    first, second = make_seq(0, 3), make_seq(1, 9)
    sched.add(first)
    resolve(sched.schedule())
    sched.add(second)
    step = sched.schedule()
    assert [(i.seq.seq_id, i.start, i.num_tokens, i.samples) for i in step] == [(0, 3, 1, True), (1, 0, 5, False)]


def test_async_schedules_on_top_of_a_pending_token() -> None:
    sched = make_scheduler()
    seq = make_seq(0, 4)
    sched.add(seq)
    sched.schedule()                 # prefill, samples token 0 (in flight)
    step = sched.schedule()          # decode of the in-flight token, scheduled before it is known
    assert [(i.start, i.num_tokens) for i in step] == [(4, 1)]
    assert seq.token_ids[4:] == [PENDING, PENDING]
    seq.resolve_pending(42)
    assert seq.token_ids[4:] == [42, PENDING]


def test_preemption_frees_the_newest_and_recomputes_everything_known() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    old, new = make_seq(0, 7), make_seq(1, 7)
    sched.add(old)
    sched.add(new)
    resolve(sched.schedule())        # both prefilled: 2 blocks each, pool full
    old.token_ids.append(PENDING)    # an output token the scheduler knows
    old.token_ids[-1] = 5
    resolve(sched.schedule())        # old needs a third block: `new` is preempted
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    assert len(new.token_ids) == 8   # its sampled token is kept and will be recomputed


def test_every_sequence_finishes_under_pressure() -> None:
    """Random prompt lengths, a tiny pool and budget: the scheduler never deadlocks or loses tokens."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, block_size=4, budget=7, max_seqs=4)
    seqs = [make_seq(i, rng.randint(1, 20), max_tokens=rng.randint(1, 12)) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    in_flight = []
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step = sched.schedule()
        for item in in_flight:       # async: the previous step's tokens arrive after this schedule
            if item.samples and not item.seq.is_finished:
                item.seq.resolve_pending(7)
                if item.seq.num_tokens - item.seq.num_pending >= item.seq.max_num_tokens:
                    item.seq.drop_pending()
                    sched.finish(item.seq)
        in_flight = step
        assert sum(i.num_tokens for i in step) <= 7
        assert sched.kv.num_free_blocks >= 0
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.token_ids[seq.num_prompt_tokens:] == [7] * seq.params.max_tokens
    assert sched.kv.num_free_blocks == 12 and sched.kv.num_free_slots == 4


def test_kv_manager_counts_blocks_and_slots() -> None:
    kv = KVCacheManager(KVPoolPlan(num_blocks=5, block_size=8, num_slots=2))
    a, b = make_seq(0, 1), make_seq(1, 1)
    assert kv.blocks_for(0) == 0 and kv.blocks_for(8) == 1 and kv.blocks_for(9) == 2
    kv.grow(a, 17)
    assert len(a.block_table) == 3 and a.slot_id >= 0
    assert kv.can_hold(b, 16) and not kv.can_hold(b, 17)
    with pytest.raises(KVPoolTooSmallError):
        kv.grow(b, 24)
    kv.release(a)
    assert kv.num_free_blocks == 5 and kv.num_free_slots == 2 and a.slot_id == -1


def test_pool_plan_from_memory() -> None:
    plan = plan_kv_pool(bytes_per_block=100, bytes_per_slot=1000, num_slots=4, block_size=8,
                        available_bytes=10_000, num_blocks=None, max_useful_blocks=1_000)
    assert plan.num_blocks == 60
    capped = plan_kv_pool(bytes_per_block=100, bytes_per_slot=1000, num_slots=4, block_size=8,
                          available_bytes=10**9, num_blocks=None, max_useful_blocks=1_000)
    assert capped.num_blocks == 1_000
    with pytest.raises(KVPoolTooSmallError, match="kv_cache_memory_fraction"):
        plan_kv_pool(bytes_per_block=100, bytes_per_slot=1000, num_slots=4, block_size=8,
                     available_bytes=4_050, num_blocks=None, max_useful_blocks=1_000)


def test_forks_start_with_the_prompt_step_or_wait_when_the_pool_is_full() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, budget=32, max_seqs=8)
    parent, roomy, squeezed = make_seq(0, 7), make_seq(1, 7), make_seq(2, 7)
    parent.forks = [roomy, squeezed]
    sched.add(parent)
    [item] = sched.schedule()
    assert item.samples and item.forks == [roomy]   # 2 blocks each: the second fork does not fit
    assert roomy.status is SequenceStatus.RUNNING and roomy.num_computed_tokens == 7
    assert roomy.token_ids[7:] == [PENDING] and len(roomy.block_table) == 2
    assert list(sched.waiting) == [squeezed] and parent.forks == []
