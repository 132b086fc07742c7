"""What a drafter receives after a target step and what it proposes for the next one.

A drafter returns draft tokens with per-position confidences; how many of them the target verifies
is decided from the confidences (`confident_prefix` for MTP's per-token rule; DeepSeek-V4.1's
DSpark block drafter uses the survival-probability budget of budget.py over the same fields).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from deepinfer_core.engine.sampler import SamplingTensors
from deepinfer_core.models.forward_batch import ForwardBatch

__all__ = ["Draft", "DraftContext", "Drafter", "confident_prefix"]


@dataclass(slots=True)
class DraftContext:
    """The accepted rows of the target step that just ran, for S sequences.

    Row r is the target's output at position batch.positions[r]; next_token_ids[r] is the token at
    the next position (an accepted draft, or the token the step sampled after the last accepted one).
    `batch` describes these rows for the drafter's own caches (context_lens = positions the drafter
    already processed); each sequence's last row is where its drafts start.
    """

    batch: ForwardBatch
    streams: torch.Tensor         # [R, ...] the drafter's input from the target (`Drafter.target_features`)
    next_token_ids: torch.Tensor  # [R] int64


@dataclass(slots=True)
class Draft:
    """Up to k draft tokens per sequence; position j of row i drafts output index sampling.positions[i] + j."""

    tokens: torch.Tensor        # [S, k] int64; entries at or past lengths[i] are -1
    confidences: torch.Tensor   # [S, k] float32: the drafter's probability that draft j is accepted once drafts < j are
    lengths: torch.Tensor       # [S] int64: drafts to verify
    probs: torch.Tensor | None  # [S, k, V] float32: the distribution sampled rows drew each draft from; None if all greedy


class Drafter(ABC):
    """Proposes drafts after each target step; owns and rolls back its own caches.

    `propose(context, sampling, max_drafts)`: `sampling` has one row per sequence whose `positions`
    is the output index of the first draft; sequence i gets at most max_drafts[i] drafts (0 = none,
    e.g. a prefill chunk that is not the prompt's last). Greedy rows (temperature 0) draft the
    argmax; sampled rows must report in `Draft.probs` the distribution their drafts were drawn from,
    with randomness independent of the target sampler's (rejection sampling relies on it).
    """

    @abstractmethod
    def propose(self, context: DraftContext, sampling: SamplingTensors, max_drafts: list[int]) -> Draft: ...

    def target_features(self, out) -> torch.Tensor:
        """What the drafter reads of the target forward that produced `out` (a ModelOutput), one row
        per token: by default the residual streams after the last block [T, hc_mult, D]."""
        return out.streams


def confident_prefix(confidences: torch.Tensor, lengths: torch.Tensor, threshold: float) -> torch.Tensor:
    """[S] int64: per row, the drafts before the first one whose confidence is below `threshold`."""
    k = confidences.shape[1]
    positions = torch.arange(k, device=confidences.device)
    confident = (confidences >= threshold) & (positions[None, :] < lengths[:, None])
    return confident.long().cumprod(dim=1).sum(dim=1)
