"""The verifier on synthetic logits: greedy prefix matching with injected drafts, rejection sampling
that keeps the target distribution (chi-square), counter-based determinism, the confidence rule."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.sampler import SamplingTensors, sample_reference
from deepinfer_core.speculative import Draft, SpeculativeStats, confident_prefix, verify
from deepinfer_core.speculative.sampling import draw, sampling_probs

VOCAB = 6
# Chi-square critical value for 5 degrees of freedom at p = 1e-4: a correct sampler exceeds it on a
# given seed with probability 1e-4, and the seeds are fixed, so the test is deterministic.
CHI2_CRITICAL_DF5 = 25.74


def rows_params(n: int, temperature: float, seeds: torch.Tensor | None = None, top_k: int = 0) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        seeds=torch.arange(n, dtype=torch.long) * 7919 + 5 if seeds is None else seeds,
        positions=torch.full((n,), 3, dtype=torch.long),
        top_k=torch.full((n,), top_k, dtype=torch.long) if top_k else None,
        top_p=None, min_p=None, all_greedy=temperature == 0.0,
    )


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_accepts_the_drafts_that_match_the_target_argmax(k) -> None:
    gen = torch.Generator().manual_seed(0)
    right = list(range(k + 1)) + [0, k]  # drafts agreeing with the target for 0..k tokens
    lengths = [k] * (k + 1) + [0, k - 1 if k > 1 else 1]
    num_seqs = len(right)
    logits = torch.randn(sum(n + 1 for n in lengths), 50, generator=gen)
    tokens = torch.full((num_seqs, k), -1, dtype=torch.long)
    start, targets = 0, []
    for i, (n, r) in enumerate(zip(lengths, right)):
        argmax = logits[start:start + n + 1].argmax(dim=-1)
        targets.append(argmax)
        for j in range(n):
            tokens[i, j] = argmax[j] if j < r else (argmax[j] + 1) % 50
        start += n + 1
    draft = Draft(tokens, torch.ones(num_seqs, k), torch.tensor(lengths), None)
    result = verify(logits, draft, rows_params(num_seqs, 0.0))
    for i, (n, r) in enumerate(zip(lengths, right)):
        accepted = min(r, n)
        assert result.num_accepted[i] == accepted
        want = [*tokens[i, :accepted].tolist(), int(targets[i][accepted])]
        assert result.tokens[i, : accepted + 1].tolist() == want
        assert (result.tokens[i, accepted + 1:] == -1).all()


def test_without_drafts_a_step_is_the_plain_sampler() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen)
    params = rows_params(64, 0.8)
    draft = Draft(torch.empty(64, 0, dtype=torch.long), torch.empty(64, 0), torch.zeros(64, dtype=torch.long), None)
    got = verify(logits, draft, params).tokens[:, 0]
    want = sample_reference(logits, params.temperature, params.seeds, params.positions)
    assert torch.equal(got, want)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    if counts[expected == 0].sum() > 0:
        return float("inf")  # drew a token the target gives probability 0
    seen = expected > 0
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k) -> None:
    """Two sampled drafts from q per sequence; output tokens 1, 2, 3 must follow p_0, p_1, p_2."""
    n, k = 40000, 2
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(k + 1, VOCAB, generator=gen) * 1.5
    draft_logits = torch.randn(k, VOCAB, generator=gen) * 1.5  # unlike the target's
    params = rows_params(n, temperature, top_k=top_k)
    drafts, probs = [], []
    for j in range(k):
        rows = SamplingTensors(
            params.temperature, params.seeds, params.positions + j, params.top_k, None, None, False
        )
        token, _, q = draw(draft_logits[j].expand(n, -1), rows)
        drafts.append(token)
        probs.append(q)
    draft = Draft(torch.stack(drafts, 1), torch.ones(n, k), torch.full((n,), k), torch.stack(probs, 1))
    result = verify(target_logits.repeat(n, 1), draft, params)
    p = sampling_probs(target_logits, rows_params(k + 1, temperature, top_k=top_k))
    emitted = result.num_emitted
    for j in range(k + 1):
        reached = emitted > j
        assert chi_square(result.tokens[reached, j], p[j]) < CHI2_CRITICAL_DF5
    # The check has power: the drafts themselves (q) fail it, and drafts are often rejected.
    assert chi_square(draft.tokens[:, 0], p[0]) > 10 * CHI2_CRITICAL_DF5
    assert 0.2 < result.num_accepted.float().mean() < 1.8


def test_rejection_sampling_with_greedy_drafts_keeps_the_target_distribution() -> None:
    """A drafter that reports no distribution drafted a point mass (its argmax)."""
    n = 40000
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(2, VOCAB, generator=gen)
    params = rows_params(n, 1.0)
    draft = Draft(torch.full((n, 1), 2, dtype=torch.long), torch.ones(n, 1), torch.ones(n, dtype=torch.long), None)
    result = verify(target_logits.repeat(n, 1), draft, params)
    p = target_logits.softmax(dim=-1)
    assert chi_square(result.tokens[:, 0], p[0]) < CHI2_CRITICAL_DF5
    assert chi_square(result.tokens[result.num_emitted > 1, 1], p[1]) < CHI2_CRITICAL_DF5


def test_seeded_verification_does_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    k, vocab = 3, 30
    lengths = [3, 1, 2]
    logits = torch.randn(sum(lengths) + 3, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (3, k), generator=gen)
    probs = torch.softmax(torch.randn(3, k, vocab, generator=gen), dim=-1)
    seeds = torch.tensor([11, 12, 13])
    params = rows_params(3, 0.9, seeds=seeds)
    together = verify(logits, Draft(tokens, torch.ones(3, k), torch.tensor(lengths), probs), params)
    start = 0
    for i, n in enumerate(lengths):
        alone = verify(
            logits[start:start + n + 1],
            Draft(tokens[i:i + 1, :n], torch.ones(1, n), torch.tensor([n]), probs[i:i + 1, :n]),
            rows_params(1, 0.9, seeds=seeds[i:i + 1]),
        )
        assert together.tokens[i, : n + 1].tolist() == alone.tokens[0].tolist()
        start += n + 1


def test_confident_prefix_stops_at_the_first_unconfident_draft() -> None:
    confidences = torch.tensor([[0.9, 0.8, 0.2], [0.3, 0.9, 0.9], [0.9, 0.9, 0.9]])
    lengths = torch.tensor([3, 3, 2])
    assert confident_prefix(confidences, lengths, 0.5).tolist() == [2, 0, 2]
    assert confident_prefix(confidences, lengths, 0.0).tolist() == [3, 3, 2]


def test_stats_count_emitted_tokens_per_position() -> None:
    stats = SpeculativeStats()
    stats.record([3, 2, 0], [1, 2, 0])
    assert stats.drafted == [2, 2, 1] and stats.accepted == [2, 1, 0]
    assert stats.acceptance_rate_per_position == [1.0, 0.5, 0.0]
    assert stats.tokens_per_step == pytest.approx(1 + 3 / 3)
