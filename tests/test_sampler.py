"""The sampler: counter-based uniforms, and the distributions temperature / top-k / top-p / min-p claim."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.engine.sampler import counter_uniform, derive_seed, filter_logits, sample_reference
from deepinfer_core.platform.kernel_ops import KernelOps

NUM_DRAWS = 40_000
# Chi-square critical value at p = 1e-3 (Wilson-Hilferty): the draws are seeded, so a pass is
# deterministic; the bound only matters for how far off a broken sampler must be to fail.
Z_999 = 3.09


def chi_square_limit(df: int) -> float:
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def draw(logits: torch.Tensor, n: int = NUM_DRAWS, seed: int = 1234, **options) -> torch.Tensor:
    """n draws for one row, as n rows that differ only in their output position."""
    rows = logits[None, :].expand(n, -1).contiguous()
    column = {name: torch.full((n,), value) for name, value in options.items()}
    temperature = column.pop("temperature", torch.ones(n))
    return sample_reference(
        rows, temperature, torch.full((n,), seed, dtype=torch.int64), torch.arange(n), **column
    )


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the claimed support was drawn"
    expected = probs[support].double() * samples.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.0])


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = probs * keep
    return kept / kept.sum()


def claimed(option: str, value: float, temperature: float = 1.0) -> torch.Tensor:
    """The distribution each option documents, written independently of `filter_logits`."""
    probs = torch.softmax(LOGITS / temperature, dim=0)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if option == "top_k":
        keep[order[: int(value)]] = True
    elif option == "top_p":
        mass = 0.0
        for token in order.tolist():
            if mass >= value:
                break
            keep[token] = True
            mass += float(probs[token])
    elif option == "min_p":
        keep = probs >= value * probs.max()
    else:
        keep[:] = True
    return renormalised(probs, keep)


@pytest.mark.parametrize(
    ("option", "value", "temperature"),
    [
        ("temperature", 1.0, 1.0),
        ("temperature", 0.5, 0.5),
        ("temperature", 2.0, 2.0),
        ("top_k", 3, 1.0),
        ("top_k", 5, 0.7),
        ("top_p", 0.8, 1.0),
        ("top_p", 0.5, 1.3),
        ("min_p", 0.2, 1.0),
        ("min_p", 0.05, 0.8),
    ],
)
def test_draws_follow_the_claimed_distribution(option: str, value: float, temperature: float) -> None:
    options = {"temperature": temperature}
    if option == "top_k":
        options["top_k"] = int(value)
    elif option != "temperature":
        options[option] = value
    samples = draw(LOGITS, **options)
    statistic, df = chi_square(samples, claimed(option, value, temperature))
    assert statistic < chi_square_limit(df), (statistic, df)


def test_chi_square_rejects_a_wrong_distribution() -> None:
    """The statistical test can fail: draws at T=1 are not the T=0.5 distribution."""
    samples = draw(LOGITS, temperature=1.0)
    statistic, df = chi_square(samples, claimed("temperature", 0.5, 0.5))
    assert statistic > 10 * chi_square_limit(df)


def test_uniforms_are_uniform_and_in_range() -> None:
    u = counter_uniform(torch.tensor([7, 2**62 + 5]), torch.tensor([0, 123456]), 50_000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    for row in u:
        # Kolmogorov-Smirnov against U(0,1); 1.95 / sqrt(n) is the p = 1e-3 critical value.
        sorted_u, _ = row.double().sort()
        grid = torch.arange(1, row.numel() + 1, dtype=torch.float64) / row.numel()
        assert float((sorted_u - grid).abs().max()) < 1.95 / math.sqrt(row.numel())


def test_uniforms_depend_only_on_seed_position_and_token() -> None:
    seeds, positions = torch.tensor([11, 99, 11, 3]), torch.tensor([4, 4, 5, 4])
    batch = counter_uniform(seeds, positions, 300)
    alone = counter_uniform(seeds[1:2], positions[1:2], 300)
    assert torch.equal(batch[1], alone[0])
    assert not torch.equal(batch[0], batch[2])  # another position, other uniforms
    assert not torch.equal(batch[0], batch[3])  # another seed, other uniforms
    assert torch.equal(counter_uniform(seeds, positions, 100), batch[:, :100])


def test_seeded_draw_is_the_same_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 400, generator=gen) * 2
    temperature = torch.tensor([0.8, 1.0, 0.0, 1.2, 0.5, 1.0])
    seeds, positions = torch.randint(0, 2**62, (6,), generator=gen), torch.arange(6) * 17
    top_k = torch.tensor([0, 20, 0, 5, 0, 0])
    together = sample_reference(logits, temperature, seeds, positions, top_k=top_k)
    order = torch.tensor([4, 2, 0, 5, 1, 3])
    shuffled = sample_reference(logits[order], temperature[order], seeds[order], positions[order],
                                top_k=top_k[order])
    assert torch.equal(shuffled, together[order])
    for i in range(6):
        alone = sample_reference(logits[i:i + 1], temperature[i:i + 1], seeds[i:i + 1], positions[i:i + 1],
                                 top_k=top_k[i:i + 1])
        assert int(alone) == int(together[i])


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    ids = sample_reference(logits, torch.zeros(5), torch.arange(5), torch.arange(5))
    assert torch.equal(ids, logits.argmax(-1))


def test_filters_keep_the_most_likely_token_at_extremes() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    kept = filter_logits(logits, torch.tensor([1, 1, 1]), torch.tensor([1e-6] * 3), torch.tensor([1.0] * 3))
    assert torch.equal(kept.isfinite().sum(-1), torch.ones(3, dtype=torch.long))
    assert torch.equal(kept.argmax(-1), logits.argmax(-1))


def test_kernel_op_matches_reference() -> None:
    logits = torch.randn(4, 77, generator=torch.Generator().manual_seed(5))
    args = (logits, torch.tensor([0.0, 1.0, 0.7, 1.5]), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 9, 9, 2]))
    assert torch.equal(KernelOps().sample(*args, top_p=torch.full((4,), 0.9)),
                       sample_reference(*args, top_p=torch.full((4,), 0.9)))


def test_derive_seed_is_stable_and_spreads() -> None:
    assert derive_seed(0, 1) == derive_seed(0, 1)
    seeds = {derive_seed(0, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    # Pinned value: a change of the derivation would silently change every unseeded request's tokens.
    assert derive_seed(0, 1) == 1227844342346046657
    assert derive_seed(12345, 7, 2) == 3742032401647958948
