"""User-facing configuration of speculative decoding."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SpeculativeConfig"]


class SpeculativeConfig(BaseModel):
    """Draft with the checkpoint's own draft layers, verify the drafts in one target step.

    - method "mtp" (DeepSeek-V4): the MTP layer proposes up to `num_draft_tokens` tokens per request
      and stops at the first draft whose own probability is below `confidence_threshold` (0 = always
      draft all of them); that draft is not verified.
    - method "dspark" (DeepSeek-V4.1): the DSpark drafter proposes a block of `num_draft_tokens`
      tokens with per-position confidences c_j (its estimate that draft j is accepted once drafts < j
      are). Request i verifies its drafts 1..n while the survival probability prod_{j<=n} c_j stays
      >= `min_survival_probability` (speculative/budget.py); with `max_verify_drafts` the step
      verifies at most that many drafts over all requests, the most likely to survive first.
    Greedy output is token-identical to decoding without speculation; sampled output keeps the target
    distribution (rejection sampling). Confidences decide how many drafts are verified, never the output.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["mtp", "dspark"] = "mtp"
    num_draft_tokens: int = Field(2, ge=1, le=16, description="Most draft tokens verified per step (k).")
    confidence_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="mtp: stop drafting once a draft's probability falls below this (t)."
    )
    min_survival_probability: float = Field(
        0.0, ge=0.0, le=1.0,
        description="dspark: verify draft n only while the product of the confidences c_1..c_n is at least this.",
    )
    max_verify_drafts: int | None = Field(
        None, ge=0, description="dspark: most drafts verified per step over all requests (None = no limit).",
    )

    @model_validator(mode="after")
    def _options_of_method(self) -> SpeculativeConfig:
        if self.method == "mtp" and (self.min_survival_probability > 0.0 or self.max_verify_drafts is not None):
            raise ValueError("`min_survival_probability` and `max_verify_drafts` choose DSpark's verification "
                             "budget; with method='mtp' use `confidence_threshold`, or set method='dspark'")
        if self.method == "dspark" and self.confidence_threshold > 0.0:
            raise ValueError("`confidence_threshold` is MTP's per-draft stop; with method='dspark' the budget comes "
                             "from `min_survival_probability` (a threshold on the product of the confidences)")
        return self
