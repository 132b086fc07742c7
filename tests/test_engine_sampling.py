"""Seeded sampling through the whole engine: the same tokens in any run, batch, position, scheduling mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

TARGET = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=4242, max_tokens=24,
                        ignore_eos=True)
TARGET_PROMPT = {"prompt_token_ids": [17, 301, 5, 88, 123, 9, 44]}


def make_llm(checkpoint: Path, **options) -> LLM:
    defaults = dict(accelerator="cpu", dtype="float32", max_num_seqs=32, max_num_batched_tokens=64,
                    num_kv_blocks=400, max_model_len=512)
    return LLM(str(checkpoint), **{**defaults, **options})


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return make_llm(tiny_checkpoint)


def mixed_batch(target_position: int) -> tuple[list, list[SamplingParams]]:
    """32 requests of assorted prompts and options, the target at `target_position`."""
    gen = torch.Generator().manual_seed(target_position)
    prompts, params = [], []
    for i in range(31):
        prompts.append({"prompt_token_ids": torch.randint(2, 512, (1 + 3 * i % 29,), generator=gen).tolist()})
        params.append(SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 5, 0][i % 3], top_p=[1.0, 0.8][i % 2],
            seed=None if i % 3 else i, max_tokens=4 + i % 20, ignore_eos=True, n=1 + (i % 7 == 0),
        ))
    prompts.insert(target_position, TARGET_PROMPT)
    params.insert(target_position, TARGET)
    return prompts, params


def target_tokens(llm: LLM, prompts=None, params=None, position: int = 0) -> list[int]:
    outputs = llm.generate(prompts or [TARGET_PROMPT], params or TARGET, use_tqdm=False)
    assert len(outputs[position].outputs[0].token_ids) == TARGET.max_tokens
    return outputs[position].outputs[0].token_ids


def test_seeded_request_is_the_same_in_every_run_batch_and_mode(llm: LLM, tiny_checkpoint: Path) -> None:
    alone = target_tokens(llm)
    assert target_tokens(llm) == alone
    for position in (0, 17, 31):
        prompts, params = mixed_batch(position)
        assert target_tokens(llm, prompts, params, position) == alone, f"in a batch at position {position}"
    sync = make_llm(tiny_checkpoint, async_scheduling=False, max_num_batched_tokens=7)
    prompts, params = mixed_batch(9)
    assert target_tokens(sync, prompts, params, 9) == alone, "async off, chunked prefill"
    assert len(set(alone)) > 5, "a sampled (not degenerate) sequence"


def test_unseeded_requests_follow_the_engine_seed(tiny_checkpoint: Path) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 3

    def run(seed: int) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in make_llm(tiny_checkpoint, seed=seed).generate(
            prompts, params, use_tqdm=False)]

    first = run(0)
    assert run(0) == first
    assert len({tuple(t) for t in first}) == 3, "each request draws its own seed"
    assert run(1) != first


def test_n_completions_are_distinct_and_the_first_matches_n1(llm: LLM) -> None:
    [output] = llm.generate([TARGET_PROMPT], TARGET.model_copy(update={"n": 3}), use_tqdm=False)
    tokens = [c.token_ids for c in output.outputs]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert tokens[0] == target_tokens(llm)
    assert len({tuple(t) for t in tokens}) == 3


def test_forked_completions_continue_from_the_copied_prompt_state(llm: LLM) -> None:
    """n > 1 prefills the prompt once; greedy forks must then decode exactly like a lone request."""
    prompt = {"prompt_token_ids": torch.randint(2, 512, (21,), generator=torch.Generator().manual_seed(3)).tolist()}
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [single] = llm.generate([prompt], greedy, use_tqdm=False)
    prefilled_before = llm.engine.stats.prefill_tokens
    [forked] = llm.generate([prompt], greedy.model_copy(update={"n": 4}), use_tqdm=False)
    assert [c.token_ids for c in forked.outputs] == [single.outputs[0].token_ids] * 4
    assert llm.engine.stats.prefill_tokens - prefilled_before == 21


def test_whole_batch_is_identical_with_async_scheduling_on_and_off(tiny_checkpoint: Path) -> None:
    """Every request (seeded, unseeded, greedy, n > 1) gives the same tokens in both modes."""
    prompts, params = mixed_batch(5)
    prompts, params = prompts[:12], [p.model_copy(update={"max_tokens": min(p.max_tokens, 10)}) for p in params[:12]]

    def run(**options) -> list[list[list[int]]]:
        outputs = make_llm(tiny_checkpoint, **options).generate(prompts, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outputs]

    assert run(async_scheduling=True) == run(async_scheduling=False, max_num_batched_tokens=9, num_kv_blocks=40)
