"""Triton `ngram_hash` (DeepSeek-V4.1's Engram hash ids) against the reference op: integer ids, exactly."""

from __future__ import annotations

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)

import pytest
import torch

from deepinfer_core.models.deepseek_v41.engram_layout import engram_multipliers, engram_offsets, engram_primes
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels.engram_hash import ngram_hash

COMPRESSED_VOCAB = 99092


def _constants(layer_ids: tuple[int, ...], n: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    primes = engram_primes(layer_ids, n, heads, 16000000)
    return (torch.from_numpy(engram_multipliers(layer_ids, n, COMPRESSED_VOCAB)), torch.tensor(primes),
            torch.tensor(engram_offsets(primes)))


def _tokens(q: int, n: int, seed: int) -> torch.Tensor:
    """Random ids with DEAD (-1) at the first shift, in the middle (live ids after it), nowhere, everywhere;
    the rows past those four DEAD at random."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, COMPRESSED_VOCAB, (q, n), generator=gen)
    tokens[torch.rand(q, n, generator=gen) < 0.15] = -1
    for row, dead in enumerate([[0], [n // 2], [], list(range(n))][:q]):
        tokens[row] = torch.randint(0, COMPRESSED_VOCAB, (n,), generator=gen)
        tokens[row, dead] = -1
    return tokens


@pytest.mark.parametrize("q", [0, 1, 7, 70])
@pytest.mark.parametrize("layer_ids, n, heads", [((1, 3), 4, 8), ((0, 2, 5), 3, 3)])
def test_ngram_hash_matches_reference(q, layer_ids, n, heads):
    """The release's layout (2 layers, 4-grams, 8 heads) and one whose 9 (layer, head) columns pad to 16;
    70 rows span three programs of the release layout's 32."""
    constants = _constants(layer_ids, n, heads)
    tokens = _tokens(q, n, seed=q)
    out = ngram_hash(tokens, 2, *constants)
    expected = KernelOps().ngram_hash(tokens, 2, *constants)
    assert out.shape == (q, len(layer_ids), (n - 1) * heads) and out.dtype == torch.int64
    assert torch.equal(out, expected)


def test_ngram_hash_reads_a_strided_view():
    """Tokens as every other column of a wider tensor (strides the kernel takes, no copy)."""
    constants = _constants((1, 3), 4, 8)
    wide = _tokens(7, 8, seed=3)
    tokens = wide[:, ::2]
    assert torch.equal(ngram_hash(tokens, 5, *constants), KernelOps().ngram_hash(tokens, 5, *constants))
