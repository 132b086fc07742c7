"""User-facing configuration of speculative decoding."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SpeculativeConfig"]


class SpeculativeConfig(BaseModel):
    """Draft with the checkpoint's MTP layer, verify the drafts in one target step.

    The drafter proposes up to `num_draft_tokens` tokens per request and stops at the first draft
    whose own probability is below `confidence_threshold` (0 = always draft all of them); that draft is
    not verified. Greedy output is token-identical to decoding without speculation; sampled output
    keeps the target distribution (rejection sampling).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["mtp"] = "mtp"
    num_draft_tokens: int = Field(2, ge=1, le=16, description="Most draft tokens verified per step (k).")
    confidence_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="Stop drafting once a draft's probability falls below this (t)."
    )
