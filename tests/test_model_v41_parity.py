"""DeepSeek-V4.1 against transformers' golden outputs with the KV quantisers off (`golden_noqat`).

kv_cache_dtype "bf16" keeps the model dtype (float32 here), which is the reference with its three QAT
fake-quantisers replaced by identity. Tolerances: 1e-4 absolute on log-probs and 1e-4 relative on the
hidden streams — the reference ran in float32 on CPU with another summation order (its own
cached-vs-full self-consistency is 1.6e-5, README `checks_noqat`); picks must be identical (the
fixtures were accepted only without ties at any top-k boundary).
"""

from __future__ import annotations

import pytest
import torch

from v41_fixtures import CONFIGS, Runner, golden, model, sorted_picks

LOGPROB_ATOL = 1e-4
STREAM_RTOL = 1e-4
ROUTER_WEIGHT_ATOL = 1e-5  # float32 routing weights from identical picks: a few ulps of O(1) values


def _max_logprob_error(logp: torch.Tensor, expected: torch.Tensor) -> float:
    return float((logp - expected).abs().max())


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_whole_prompts_match_golden_layer_by_layer(name: str) -> None:
    m, g = model(name, "bf16"), golden(name, quantized=False)
    prompts = [g[f"prompt{i}.input_ids"] for i in range(3)]
    slots = (2, 0, 1)  # prompt i in slot slots[i]; batch rows in slot order 2, 0, 1 -> prompts 0, 1, 2
    m.trace.start()
    logp = Runner(m).step({slots[i]: prompts[i] for i in range(3)})
    records = m.trace.stop()
    starts = [0, len(prompts[0]), len(prompts[0]) + len(prompts[1])]
    for i, ids in enumerate(prompts):
        rows = slice(starts[i], starts[i] + len(ids))
        assert _max_logprob_error(logp[rows], g[f"prompt{i}.logprobs"]) < LOGPROB_ATOL, f"prompt {i}"

    rows = slice(starts[1], starts[1] + len(prompts[1]))
    n_layers = g["prompt1.hidden_streams"].shape[0]
    for layer in range(n_layers):
        streams, expected = records[f"hidden_streams.layer{layer}"][rows], g["prompt1.hidden_streams"][layer]
        rel = (streams - expected).abs().max() / expected.abs().max()
        assert rel < STREAM_RTOL, f"layer {layer} streams rel err {rel}"
        torch.testing.assert_close(records[f"pre_mix.layer{layer}"][rows], g["prompt1.pre_mix"][layer],
                                   rtol=STREAM_RTOL, atol=1e-6)
        assert torch.equal(records[f"router_indices.layer{layer}"][rows].int(), g[f"prompt1.router_indices.layer{layer}"])
        torch.testing.assert_close(records[f"router_weights.layer{layer}"][rows],
                                   g[f"prompt1.router_weights.layer{layer}"], rtol=0, atol=ROUTER_WEIGHT_ATOL)
    torch.testing.assert_close(records["final_hidden"][rows], g["prompt1.final_hidden"], rtol=STREAM_RTOL, atol=1e-5)

    index_layers = [k.split(".")[-1] for k in g if k.startswith("prompt1.index_topk.")]
    assert index_layers, "fixture has no indexer goldens"
    for layer in index_layers:
        assert torch.equal(sorted_picks(records[f"index_topk.{layer}"][rows]), g[f"prompt1.index_topk.{layer}"]), layer
    (candidate_key,) = [k for k in g if k.startswith("prompt1.candidates.")]
    layer = candidate_key.split(".")[-1]
    assert torch.equal(records[f"candidates.{layer}.seq1"].to(torch.uint8), g[candidate_key])


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_decode_through_cache_matches_golden(name: str) -> None:
    """Prefill all three prompts in one batch, then 32 batched single-token decode steps."""
    _check_greedy(name, "bf16", LOGPROB_ATOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_greedy_decode_matches_golden_tokens(name: str) -> None:
    """With the KV formats on, the tokens must still match; the chosen log-probs may move by a rounding
    flip (the reference's own cached generate differs from its full forward by up to 5.1e-2 here,
    README `checks`), so they get that bound instead of 1e-4."""
    _check_greedy(name, "fp8_fp4", 6e-2)


def _check_greedy(name: str, kv_cache_dtype: str, logprob_atol: float) -> None:
    m, g = model(name, kv_cache_dtype), golden(name, quantized=kv_cache_dtype != "bf16")
    runner = Runner(m)
    logp = runner.step({i: g[f"prompt{i}.input_ids"] for i in range(3)})
    ends = torch.tensor([len(g[f"prompt{i}.input_ids"]) for i in range(3)]).cumsum(0) - 1
    last = logp[ends]
    tokens, chosen = [[] for _ in range(3)], [[] for _ in range(3)]
    for _ in range(32):
        picks = last.argmax(-1)
        for i in range(3):
            tokens[i].append(int(picks[i]))
            chosen[i].append(float(last[i, picks[i]]))
        last = runner.step({i: picks[i:i + 1] for i in range(3)})
    for i in range(3):
        assert tokens[i] == g[f"prompt{i}.greedy_tokens"].tolist(), f"prompt {i}"
        assert _max_logprob_error(torch.tensor(chosen[i]), g[f"prompt{i}.greedy_logprobs"]) < logprob_atol


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_with_odd_chunks_matches_golden(name: str) -> None:
    """Prompts 1 and 2 in odd chunks that split compress groups and candidate blocks, sharing steps."""
    m, g = model(name, "bf16"), golden(name, quantized=False)
    runner = Runner(m)
    chunks = {1: [1, 5, 37, 47], 2: [3, 1, 37, 53, 7, 199]}
    pieces: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    offsets = {1: 0, 2: 0}
    for step in range(max(len(c) for c in chunks.values())):
        todo = {}
        for p, sizes in chunks.items():
            if step < len(sizes):
                ids = g[f"prompt{p}.input_ids"]
                todo[p] = ids[offsets[p]:offsets[p] + sizes[step]]
                offsets[p] += sizes[step]
        logp = runner.step(todo)
        start = 0
        for p, ids in todo.items():
            pieces[p].append(logp[start:start + len(ids)])
            start += len(ids)
    for p in chunks:
        assert offsets[p] == len(g[f"prompt{p}.input_ids"])
        assert _max_logprob_error(torch.cat(pieces[p]), g[f"prompt{p}.logprobs"]) < LOGPROB_ATOL, f"prompt {p}"


def test_decode_scores_in_sequence_chunks_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step whose keys exceed the indexer's budget scores a few sequences at a time: the same
    log-probs as one pass over all of them (every band kind, fp8 / fp4 KV)."""
    from deepinfer_core.models.deepseek_v41 import indexer

    prompts = {slot: torch.arange(slot, 60 + 13 * slot) % 190 + 3 for slot in range(3)}

    def decode_after_prefill() -> torch.Tensor:
        runner = Runner(model("b_mixed_ratios", "fp8_fp4"))
        for slot, prompt in prompts.items():
            runner.step({slot: prompt})
        return runner.step({slot: torch.tensor([7 + slot]) for slot in prompts})

    whole = decode_after_prefill()
    monkeypatch.setattr(indexer, "DECODE_SCORE_ELEMENTS", 1)  # one sequence a chunk
    assert torch.equal(decode_after_prefill(), whole)
