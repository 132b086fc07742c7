"""Verification of drafts against the target's logits: greedy matching or rejection sampling.

The target ran one step over [last token, draft 1 .. draft n] per sequence; its row j holds the
distribution p_j of output index positions + j. Greedy rows accept the longest prefix of drafts that
equal the target's argmax. Sampled rows accept draft j with probability min(1, p_j(d) / q_j(d)) (q_j
the draft's distribution) and, at the first rejection, draw from normalise(max(p_j - q_j, 0));
this keeps every output token distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).
After n acceptances the next token is drawn from p_n by the engine's own sampler, so with no drafts
a step is exactly a plain decode step. All randomness is keyed on (seed, output index).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.engine.sampler import (
    SamplingTensors,
    counter_uniform,
    sample_reference,
)

from .drafter import Draft
from .sampling import (
    ACCEPT_STREAM,
    keyed_uniform,
    repeat_rows,
    sampling_probs,
    select_rows,
)

__all__ = ["Verification", "verify"]


@dataclass(slots=True)
class Verification:
    tokens: torch.Tensor        # [S, k+1] int64: the accepted drafts, then one target token; -1 after
    num_accepted: torch.Tensor  # [S] int64: drafts accepted; the step emits num_accepted + 1 tokens

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify(
    logits: torch.Tensor, draft: Draft, sampling: SamplingTensors, sample: Callable[..., torch.Tensor] = sample_reference
) -> Verification:
    """logits: [T, V] float32, sequence i's lengths[i] + 1 rows consecutive, in order.
    sampling: one row per sequence, positions = output index of the step's first token.
    sample: the engine's sampler (`KernelOps.sample`), which draws the token after the accepted drafts.
    Nothing is synchronised with the host."""
    num_seqs, k = draft.tokens.shape
    seqs = torch.arange(num_seqs, device=logits.device)
    target = _rows_per_sequence(logits, draft.lengths, k)
    drafts = draft.tokens.clamp(min=0)
    drafted = torch.arange(k, device=logits.device)[None, :] < draft.lengths[:, None]
    accepted = drafts == target[:, :k].argmax(dim=-1)
    sampled = sampling.temperature > 0.0
    use_ratio = k > 0 and not sampling.all_greedy
    if use_ratio:
        accepted = torch.where(sampled[:, None], _accepted_by_ratio(target[:, :k], draft, sampling), accepted)
    num_accepted = (accepted & drafted).long().cumprod(dim=1).sum(dim=1)
    final_logits = target[seqs, num_accepted]
    at = select_rows(sampling, seqs, num_accepted)
    final = sample(final_logits, at.temperature, at.seeds, at.positions, at.top_k, at.top_p, at.min_p)
    if use_ratio:
        rejected = (num_accepted < draft.lengths) & sampled
        final = torch.where(rejected, _residual_draw(final_logits, draft, num_accepted, at), final)
    tokens = torch.nn.functional.pad(drafts, (0, 1))
    tokens[seqs, num_accepted] = final
    tokens = tokens.masked_fill(torch.arange(k + 1, device=logits.device)[None, :] > num_accepted[:, None], -1)
    return Verification(tokens, num_accepted)


def _rows_per_sequence(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[S, k+1, V]: sequence i's rows, its last one repeated past lengths[i]."""
    starts = torch.cumsum(lengths + 1, 0) - (lengths + 1)
    j = torch.arange(k + 1, device=logits.device)
    return logits[starts[:, None] + torch.minimum(j[None, :], lengths[:, None])]


def _accepted_by_ratio(target: torch.Tensor, draft: Draft, sampling: SamplingTensors) -> torch.Tensor:
    """[S, k] bool: u < p_j(d_j) / q_j(d_j), written u * q < p so that q = 0 never divides.
    A drafter without `probs` drafted a point mass: q(d) = 1."""
    num_seqs, k, vocab = target.shape
    per_draft = repeat_rows(sampling, k)
    drafts = draft.tokens.clamp(min=0).reshape(-1, 1)
    p_draft = sampling_probs(target.reshape(-1, vocab), per_draft).gather(1, drafts)[:, 0]
    if draft.probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft.probs.reshape(-1, vocab).gather(1, drafts)[:, 0]
    u = keyed_uniform(per_draft.seeds, per_draft.positions, 1, ACCEPT_STREAM)[:, 0]
    return (u * q_draft < p_draft).view(num_seqs, k)


def _residual_draw(
    logits: torch.Tensor, draft: Draft, num_accepted: torch.Tensor, sampling: SamplingTensors
) -> torch.Tensor:
    """[S]: a draw from normalise(max(p - q, 0)) at each sequence's first rejected draft, with the
    target sampler's own uniforms for that output index."""
    seqs = torch.arange(len(num_accepted), device=logits.device)
    at = num_accepted.clamp(max=draft.tokens.shape[1] - 1)
    p = sampling_probs(logits, sampling)
    if draft.probs is None:
        q = torch.zeros_like(p).scatter_(1, draft.tokens[seqs, at].clamp(min=0)[:, None], 1.0)
    else:
        q = draft.probs[seqs, at]
    residual = (p - q).clamp(min=0.0)
    # p == q leaves nothing: then acceptance was certain and this row is never used.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    gumbel = -torch.log(-torch.log(counter_uniform(sampling.seeds, sampling.positions, logits.shape[-1])))
    return (residual.log() + gumbel).argmax(dim=-1)
