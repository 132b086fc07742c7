"""Distributions and counter-based randomness shared by the drafter and the verifier.

Every draw is keyed on (request seed, output index) like the engine's sampler, on streams of their
own: the draft draw, the acceptance test and the target's own draw never share a uniform.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sampler import (
    SamplingTensors,
    counter_uniform,
    filter_logits,
)

__all__ = ["ACCEPT_STREAM", "DRAFT_STREAM", "draw", "keyed_uniform", "repeat_rows", "sampling_probs", "select_rows"]

# XOR-ed into the seed: a bijection on 63-bit seeds, so each stream is a different counter key.
DRAFT_STREAM = 0x2D6F_A1C3_5B79_E04B
ACCEPT_STREAM = 0x5A0C_93E7_1F24_B6D1


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """[N, width] float32 uniforms in (0, 1) of stream `stream` (0 = the engine sampler's own)."""
    return counter_uniform(seeds ^ stream, positions, width)


def draw(logits: torch.Tensor, sampling: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A drafter's draw: (tokens [N], their probabilities [N], the distribution [N, V] sampled rows
    drew from, None when all rows are greedy). Greedy rows take the argmax; its probability is under
    softmax(logits). Sampled rows draw from `sampling_probs` on the DRAFT_STREAM."""
    greedy_token = logits.argmax(dim=-1)
    greedy_conf = logits.float().softmax(dim=-1).gather(1, greedy_token[:, None])[:, 0]
    if sampling.all_greedy:
        return greedy_token, greedy_conf, None
    q = sampling_probs(logits, sampling)
    uniform = keyed_uniform(sampling.seeds, sampling.positions, logits.shape[-1], DRAFT_STREAM)
    sampled = (q.log() - torch.log(-torch.log(uniform))).argmax(dim=-1)
    greedy = sampling.temperature <= 0.0
    token = torch.where(greedy, greedy_token, sampled)
    confidence = torch.where(greedy, greedy_conf, q.gather(1, sampled[:, None])[:, 0])
    return token, confidence, q


def sampling_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """[N, V] float32: the distribution a row's token is drawn from, softmax(filters(logits / T));
    a greedy row (temperature 0) gets the point mass on its argmax."""
    logits = logits.float()
    greedy = sampling.temperature <= 0.0
    scaled = logits / torch.where(greedy, 1.0, sampling.temperature)[:, None]
    probs = filter_logits(scaled, sampling.top_k, sampling.top_p, sampling.min_p).softmax(dim=-1)
    point = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], point, probs)


def select_rows(sampling: SamplingTensors, index: torch.Tensor, offsets: torch.Tensor | int = 0) -> SamplingTensors:
    """Rows `index` of `sampling`, their output indices moved on by `offsets`."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]

    return SamplingTensors(
        temperature=sampling.temperature[index], seeds=sampling.seeds[index],
        positions=sampling.positions[index] + offsets, top_k=pick(sampling.top_k),
        top_p=pick(sampling.top_p), min_p=pick(sampling.min_p), all_greedy=sampling.all_greedy,
    )


def repeat_rows(sampling: SamplingTensors, width: int) -> SamplingTensors:
    """Each row `width` times in a row, its j-th copy at output index positions + j."""
    device = sampling.positions.device
    index = torch.arange(len(sampling.positions), device=device).repeat_interleave(width)
    offsets = torch.arange(width, device=device).repeat(len(sampling.positions))
    return select_rows(sampling, index, offsets)
