"""Greedy generation and logprobs of the whole engine against transformers' full-sequence forward.

One batch exercises everything at once: 16 prompts of 1 .. 5x sliding_window tokens (crossing CSA
(4) and HCA (8) compression boundaries), 200 new tokens each, a token budget that forces chunked
prefill, and a KV pool small enough to force preemption by recompute; with async scheduling on and
off. Every generated token is re-scored by transformers on prompt + output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

PROMPT_LENS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24, 33, 40]
NEW_TOKENS = 200
# float32 on both sides; logits differ by ~1e-6 (summation order), so a near-tie below this
# margin may legitimately pick the other token: stop comparing that request there.
TIE_MARGIN = 1e-3
LOGPROB_TOL = 1e-4


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with index_topk above the entry count of the longest sequence (60).

    NOTE: with top-k selection active, exact ties at zero indexer score (ReLU) make transformers'
    own choice arbitrary (MODEL_SPEC §4.4; seen here at a 110-token context: three entries tied at
    0.0 for two places). Selection parity is the model tests' job; here every entry is selected.
    """
    from deepinfer_core.tools import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-parity") / "tiny", overrides={"index_topk": 64})


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async_on", "async_off"])
def test_greedy_matches_transformers(checkpoint: Path, hf_model, async_scheduling: bool) -> None:
    llm = LLM(
        str(checkpoint), accelerator="cpu", dtype="float32", async_scheduling=async_scheduling,
        max_num_batched_tokens=24, max_num_seqs=16, num_kv_blocks=160, max_model_len=1024,
    )
    vocab = llm.model_config.vocab_size
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2,
                       prompt_logprobs=3 if i % 4 == 0 else None)
        for i in range(len(PROMPT_LENS))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False)

    stats = llm.engine.stats
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert max(s.prefill_tokens for s in stats.recent) <= 24
    compared = rescored = 0
    for output, sp in zip(outputs, params):
        completion = output.outputs[0]
        assert len(completion.token_ids) == NEW_TOKENS and completion.finish_reason == "length"
        full = output.prompt_token_ids + completion.token_ids
        ref = hf_logprobs(hf_model, full)
        start = len(output.prompt_token_ids) - 1
        for k, token in enumerate(completion.token_ids):
            row = ref[start + k]
            if not agrees(row, token, completion.logprobs[k]):
                # NOTE: transformers' indexer scores come from a matmul whose rounding depends on
                # the sequence length, so a near-tie in CSA top-k selection can flip between a
                # 60- and a 200-token forward. The token was generated from its prefix alone:
                # score it on exactly that prefix.
                row = hf_logprobs(hf_model, full[:start + k + 1])[-1]
                rescored += 1
            top2 = row.topk(2).values
            if int(row.argmax()) != token:
                assert float(top2[0] - top2[1]) < TIE_MARGIN, (output.request_id, k)
                break
            for top_id, value in completion.logprobs[k].items():
                assert abs(value - float(row[top_id])) < LOGPROB_TOL, (output.request_id, k, top_id)
            compared += 1
        if sp.prompt_logprobs is not None:
            assert output.prompt_logprobs[0] is None
            assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
            for position in range(1, len(output.prompt_token_ids)):
                entry = output.prompt_logprobs[position]
                assert output.prompt_token_ids[position] in entry and len(entry) >= 3
                for token_id, value in entry.items():
                    assert abs(value - float(ref[position - 1, token_id])) < LOGPROB_TOL
    assert compared >= 0.75 * NEW_TOKENS * len(PROMPT_LENS)
    assert rescored <= 0.02 * compared, "prefix re-scoring is for rare indexer near-ties only"


def agrees(row: torch.Tensor, token: int, logprobs: dict[int, float]) -> bool:
    return int(row.argmax()) == token and all(abs(v - float(row[t])) < LOGPROB_TOL for t, v in logprobs.items())
