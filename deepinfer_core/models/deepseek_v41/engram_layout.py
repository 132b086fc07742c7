"""Engram hash-table layout (MODEL_SPEC_V41 §6.3-6.4): primes, offsets, multipliers, table sizes.

Every (engram layer, n-gram size, head) owns a bucket range whose size is a prime. Primes are drawn
in that order, each the next prime above `engram_vocab_size - 1` not used anywhere before (one
global set), so the layout, and therefore each layer's table size, follows from the config alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["engram_primes", "engram_offsets", "engram_num_embeddings", "engram_multipliers"]

_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """primes[layer][n-gram size - 2][head], drawn as the module docstring says."""
    seen: set[int] = set()
    layers = []
    for _ in layer_ids:
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            heads, candidate = [], vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in seen or not _is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
            per_ngram.append(heads)
        layers.append(per_ngram)
    return layers


def engram_offsets(primes: list[list[list[int]]]) -> list[list[int]]:
    """offsets[layer][(n-gram - 2) * n_heads + head]: running sums of that layer's primes from 0."""
    out = []
    for layer in primes:
        flat = [p for heads in layer for p in heads]
        out.append([sum(flat[:i]) for i in range(len(flat))])
    return out


def engram_num_embeddings(layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int) -> list[int]:
    """Rows of each engram layer's table = the sum of its primes."""
    primes = engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
    return [sum(p for heads in layer for p in heads) for layer in primes]


def engram_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd int64 multipliers [n_layers, max_ngram_size]: 2u+1, u from numpy's default_rng(10007 * layer).

    u < (2^63 - 1) // compressed_vocab_size // 2, so id * multiplier never overflows int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
            for layer in layer_ids]
    return np.stack(rows) * 2 + 1 if rows else np.zeros((0, max_ngram_size), dtype=np.int64)
