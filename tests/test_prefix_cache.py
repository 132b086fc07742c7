"""Prefix caching through the whole engine (`LLM`, cpu backend, float32), against the same engine with
caching off.

Exact mode must give the bitwise-same tokens and log-probs. Bitwise needs the suffix computed in the
same chunks as without reuse (GEMM rows can differ in the last bit between chunkings, measured
<1e-5, with or without reuse): the plain tests use a token budget of one block, so both runs chunk at
the same block boundaries. The tests whose schedules differ with and without caching (preemption,
eviction, several sequences per step) compare tokens exactly and log-probs within LOGPROB_ATOL:
`batch_invariant` mode does not make V4.1 invariant to the batch's composition (measured 3.5e-6
between a prompt alone and in a batch of three, caching off). Bounded mode (V4.1) must equal exact
once the replay span covers every layer's window cone (layers * (window - 1)) and differ with a
short span.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from v41_fixtures import FIXTURES

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.prefix_cache import PrefixReuseUnavailable
from deepinfer_core.speculative import SpeculativeConfig

V41 = FIXTURES / "b_mixed_ratios" / "checkpoint"  # 7 layers, window 8, ratios 4/2/1, an engram layer
V41_CONE = 7 * (8 - 1)
BLOCK = 8
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-4  # schedule-dependent GEMM rounding (see above), far below a real state error (>1e-2)


@pytest.fixture(scope="module")
def v4_checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


def build(checkpoint: Path, **options) -> LLM:
    settings = {"accelerator": "cpu", "dtype": "float32", "max_num_seqs": 4, "num_kv_blocks": 64,
                "max_num_batched_tokens": BLOCK, "async_scheduling": False}
    if checkpoint == V41:
        settings["block_size"] = BLOCK
    return LLM(str(checkpoint), **(settings | options))


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def run(llm: LLM, prompts: list[list[int]], together: bool = False) -> list[tuple[list[int], list]]:
    """Each prompt's (tokens, log-probs); one request after the other unless `together`."""
    batches = [prompts] if together else [[p] for p in prompts]
    outputs = []
    for batch in batches:
        outputs += llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_close(got: list, want: list) -> None:
    for (tokens_got, lp_got), (tokens_want, lp_want) in zip(got, want, strict=True):
        assert tokens_got == tokens_want
        for row_got, row_want, token in zip(lp_got, lp_want, tokens_want):
            assert abs(row_got[token] - row_want[token]) <= LOGPROB_ATOL


def shared_prompts(vocab: int, first: int, second: int) -> list[list[int]]:
    """A prompt, then one that extends it (the next turn of a conversation)."""
    base = tokens(0, second, vocab)
    return [base[:first], base]


@cache
def reference(checkpoint: Path, first: int, second: int, vocab: int, options: tuple = ()) -> list:
    return run(build(checkpoint, **dict(options)), shared_prompts(vocab, first, second))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_v41_exact_reuse_is_bitwise_and_really_hits(async_scheduling: bool) -> None:
    llm = build(V41, enable_prefix_caching=True, async_scheduling=async_scheduling)
    got = run(llm, shared_prompts(200, 61, 70))
    # The second prompt starts after the first one's last full block before its last token: 56.
    assert (llm.kv.prefix.num_hits, llm.kv.prefix.num_reused_tokens) == (1, 56)
    assert got == reference(V41, 61, 70, 200)


def test_v41_identical_prompt_reuses_all_but_its_last_block() -> None:
    llm = build(V41, enable_prefix_caching=True)
    prompt = tokens(1, 48, 200)
    got = run(llm, [prompt, prompt])
    assert llm.kv.prefix.num_reused_tokens == 40  # the 48th token's logits need its block computed
    assert got[0] == got[1] == run(build(V41), [prompt])[0]


def test_prompt_logprobs_requests_compute_every_position_and_still_seed_the_cache() -> None:
    llm = build(V41, enable_prefix_caching=True)
    prompt = tokens(2, 30, 200)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    first, again = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for _ in range(2))
    assert llm.kv.prefix.num_hits == 0 and again.prompt_logprobs == first.prompt_logprobs
    run(llm, [prompt + [5]])
    assert llm.kv.prefix.num_reused_tokens == 24


def test_v4_exact_reuse_is_bitwise_and_really_hits(v4_checkpoint: Path) -> None:
    llm = build(v4_checkpoint, enable_prefix_caching=True)
    block = llm.kv.block_size
    first, second = 3 * block + 3, 4 * block + 5
    vocab = llm.model_config.vocab_size
    got = run(llm, shared_prompts(vocab, first, second))
    assert llm.kv.prefix.num_reused_tokens == 3 * block
    assert got == reference(v4_checkpoint, first, second, vocab)


def test_eviction_under_memory_pressure_keeps_outputs() -> None:
    """A pool of 14 blocks: four 40-token prompts (5 blocks each, 3 at once) evict each other's
    cached blocks; the repeats hit or miss depending on what survived, and must not change a token."""
    prompts = [tokens(10 + i, 40, 200) for i in range(4)]
    prompts += [prompts[0] + tokens(20, 9, 200), prompts[3] + tokens(21, 9, 200), prompts[1]]
    options = {"num_kv_blocks": 14, "max_num_seqs": 3, "max_num_batched_tokens": 32}
    cached = build(V41, enable_prefix_caching=True, **options)
    got = run(cached, prompts, together=True) + run(cached, prompts[4:])
    assert cached.kv.prefix.num_hits > 0 and cached.kv.prefix.num_evicted_blocks > 0
    plain = build(V41, **options)
    assert_close(got, run(plain, prompts, together=True) + run(plain, prompts[4:]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hits_with_chunked_prefill_and_preemption(async_scheduling: bool) -> None:
    """Prompts sharing a long prefix arrive together in a pool too small for all of them: chunked
    prefills, preemptions (their re-prefill may itself hit), and hits in later rounds."""
    stem = tokens(30, 33, 200)
    prompts = [stem + tokens(40 + i, 7 + 4 * i, 200) for i in range(4)]
    options = {"num_kv_blocks": 10, "max_num_batched_tokens": 12, "async_scheduling": async_scheduling}
    cached = build(V41, enable_prefix_caching=True, **options)
    warm = run(cached, [stem + [1]])
    got = run(cached, prompts, together=True)
    assert cached.kv.prefix.num_hits >= 4 and cached.engine.scheduler.num_preemptions > 0
    plain = build(V41, **options)
    assert_close(warm + got, run(plain, [stem + [1]]) + run(plain, prompts, together=True))


def test_bounded_replay_over_the_window_cone_equals_exact_and_a_short_span_differs() -> None:
    exact = reference(V41, 61, 70, 200)
    covering = build(V41, enable_prefix_caching=True, prefix_reuse="bounded", decoder_replay_span=V41_CONE)
    assert run(covering, shared_prompts(200, 61, 70)) == exact
    assert covering.kv.prefix.num_replayed_tokens == 56  # the replay start rounds down to a block: 0
    short = build(V41, enable_prefix_caching=True, prefix_reuse="bounded", decoder_replay_span=BLOCK)
    got = run(short, shared_prompts(200, 61, 70))
    assert short.kv.prefix.num_replayed_tokens == BLOCK
    assert got[0] == exact[0] and got[1] != exact[1]


def test_bounded_replay_covering_the_cone_from_mid_prompt_equals_exact() -> None:
    """A longer shared prefix: the replay starts at position 48 > 0, below it nothing is recomputed."""
    options = (("num_kv_blocks", 96),)
    exact = reference(V41, 118, 125, 200, options)
    covering = build(V41, enable_prefix_caching=True, prefix_reuse="bounded",
                     decoder_replay_span=V41_CONE + BLOCK, **dict(options))
    assert run(covering, shared_prompts(200, 118, 125)) == exact
    assert (covering.kv.prefix.num_reused_tokens, covering.kv.prefix.num_replayed_tokens) == (48, 64)


def test_v41_exact_mode_reuses_a_shared_stem_by_replaying_the_window_cone() -> None:
    """Two prompts share a 70-token stem, then differ: no snapshot sits where they part, so the exact
    mode replays the window cone (49 positions, from 8 since 64 - 49 rounds down to a block) before
    the shared 64 and must still equal caching off bitwise."""
    stem = tokens(50, 70, 200)
    prompts = [stem + tokens(51, 9, 200), stem + tokens(52, 11, 200)]
    options = {"num_kv_blocks": 96}
    cached = build(V41, enable_prefix_caching=True, **options)
    got = run(cached, prompts)
    prefix = cached.kv.prefix
    assert (prefix.num_hits, prefix.num_reused_tokens, prefix.num_replayed_tokens) == (1, 8, 56)
    assert got == run(build(V41, **options), prompts)


def test_unservable_combinations_are_refused(v4_checkpoint: Path) -> None:
    with pytest.raises(PrefixReuseUnavailable, match="bounded"):
        build(v4_checkpoint, enable_prefix_caching=True, prefix_reuse="bounded")
    with pytest.raises(PrefixReuseUnavailable, match="speculative"):
        build(v4_checkpoint, enable_prefix_caching=True, speculative=SpeculativeConfig(num_draft_tokens=1))


def test_block_accounting_shares_idles_and_evicts_least_recent_first() -> None:
    """Two holders of a cached block; released blocks stay named until taken back, tail first, and
    an evicted block's snapshot goes with it."""
    from deepinfer_core.engine.kv_cache import KVCacheManager, KVPoolPlan
    from deepinfer_core.engine.prefix_cache import PrefixReuse
    from deepinfer_core.engine.sampling_params import SamplingParams as Params
    from deepinfer_core.engine.sequence import Sequence

    kv = KVCacheManager(KVPoolPlan(num_blocks=4, block_size=2, num_slots=2, num_snapshots=1), PrefixReuse("exact", 0, 1))

    def sequence(seq_id: int, ids: list[int]) -> Sequence:
        return Sequence(seq_id, seq_id, 0, list(ids), len(ids), len(ids) + 1, Params(max_tokens=1), 0, None)

    first = sequence(0, [1, 2, 3, 4, 5])
    assert kv.match_prefix(first) is None
    kv.start_from(first, None)
    assert first.snapshot_at == 4
    kv.grow(first, 4)
    first.num_computed_tokens = 4
    assert kv.computed(first, 0) == 2  # the snapshot slot follows the two sequence slots
    kv.commit()
    second = sequence(1, [1, 2, 3, 4, 9, 9])
    hit = kv.match_prefix(second)
    assert (hit.blocks, hit.start, hit.snapshot_slot) == (first.block_table, 4, 2)
    assert kv.can_hold(second, 6, hit) and not kv.can_hold(second, 11, hit)
    kv.start_from(second, hit)
    kv.release(first)
    assert kv.num_free_blocks == 2 and not kv.prefix.idle  # both blocks still held by `second`
    kv.release(second)
    assert list(kv.prefix.idle) == [1, 0] and kv.num_free_blocks == 4
    third = sequence(2, [7, 7, 7, 7, 7, 7, 7])
    kv.grow(third, 6)  # two unused blocks, then the least recent idle one: the prefix's tail
    assert third.block_table[2] == 1 and kv.prefix.num_evicted_blocks == 1
    assert kv.match_prefix(sequence(3, [1, 2, 3, 4, 5])) is None  # its snapshot went with the tail
