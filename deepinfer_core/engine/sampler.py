"""Token sampling: the reference math behind `KernelOps.sample`, and the per-step glue that feeds it.

Randomness is counter-based: the uniform for (request seed, output position, token id) is an
integer hash computed with torch integer ops, so a seeded request draws the same tokens alone or in
any batch, in any run or process, with asynchronous scheduling on or off, on any device. A token
is drawn with the Gumbel-max trick, argmax(logit / T + Gumbel(u)), which samples softmax(logit / T)
over the tokens the filters keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.sampling_params import SamplingParams

__all__ = [
    "counter_uniform",
    "derive_seed",
    "filter_logits",
    "sample_reference",
    "SamplingTensors",
    "compute_logprobs",
]

_MASK32 = 0xFFFFFFFF
_MASK63 = (1 << 63) - 1
# Odd multipliers below 2**31, so a 32-bit value times one never overflows int64.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
_MUL_C = 0x297A2D39
_SALT_POSITION = 0x68E31DA4
_SALT_TOKEN = 0x1B56C4E9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of int64 values in [0, 2**32) into another such tensor."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL_C) & _MASK32
    return x ^ (x >> 15)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [N, V]: a pure function of (seeds[i], positions[i], token id).

    seeds: [N] int64 in [0, 2**63); positions: [N] int64 >= 0 (index of the output token).
    24 random bits per value, so every value is exact in float32 on every device.
    """
    seeds = seeds.to(torch.int64)
    key = _mix32(_mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ ((positions.to(torch.int64) + _SALT_POSITION) & _MASK32))
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ token_ids[None, :]) ^ ((key[:, None] + _SALT_TOKEN) & _MASK32))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set to -inf every token the filters drop, in this order: top_k (0 = off) keeps the k most
    likely (ties broken towards the lower id); top_p (>= 1 = off) keeps the smallest prefix of
    what top_k kept whose renormalised mass reaches p; min_p keeps tokens with probability at
    least min_p times the most likely one's. The most likely token always survives."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        keep &= (rank[None, :] < top_k[:, None]) | (top_k[:, None] <= 0)
    if top_p is not None:
        kept = probs * keep
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = kept.cumsum(dim=-1) - kept
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    if min_p is not None:
        keep &= probs >= min_p[:, None] * probs[:, :1]
    keep_by_id = torch.empty_like(keep).scatter_(-1, order, keep)
    return logits.masked_fill(~keep_by_id, float("-inf"))


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `KernelOps.sample` for the contract."""
    logits = logits.float()
    greedy = temperature <= 0.0
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    scaled = filter_logits(scaled, top_k, top_p, min_p)
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, positions, logits.shape[-1])))
    drawn = (scaled + gumbel).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def derive_seed(base: int, *salt: int) -> int:
    """A 63-bit seed from `base` and integers (splitmix64 steps): the same inputs, the same seed."""
    x = base & _MASK63
    for value in salt:
        x = (x + 0x9E3779B97F4A7C15 + value) & ((1 << 64) - 1)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        x ^= x >> 31
    return x & _MASK63


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, on the device. A filter is None when no row uses it."""

    temperature: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    all_greedy: bool  # then the draw is a plain argmax: no [N, V] uniforms to generate

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        device: torch.device,
    ) -> SamplingTensors:
        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        def optional(values: list, is_off, dtype: torch.dtype) -> torch.Tensor | None:
            return None if all(is_off(v) for v in values) else column(values, dtype)

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            seeds=column(seeds, torch.int64),
            positions=column(positions, torch.int64),
            top_k=optional([p.top_k for p in params], lambda k: k == 0, torch.int64),
            top_p=optional([p.top_p for p in params], lambda p: p >= 1.0, torch.float32),
            min_p=optional([p.min_p for p in params], lambda p: p <= 0.0, torch.float32),
            all_greedy=all(p.greedy for p in params),
        )


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities under the raw distribution: of `token_ids` [N] -> [N], and the `num_top`
    most likely tokens per row -> ([N, num_top] values, [N, num_top] ids), None when num_top is 0."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None].to(torch.int64))[:, 0]
    if num_top == 0:
        return chosen, None, None
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_values, top_ids
