"""Per-request sampling options (validated; a bad value raises naming the field)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepinfer_core.engine.structured import StructuredOutput

__all__ = ["SamplingParams"]

_MAX_SEED = 2**63 - 1


class SamplingParams(BaseModel):
    """How to draw the tokens of one request.

    temperature 0 is greedy. Filters apply in this order to the temperature-scaled distribution:
    top_k (0 = off), top_p (1 = off, on what top_k kept), min_p (0 = off, relative to the most
    likely token). A seeded request draws the same tokens in any batch and any run; an unseeded
    one derives its seed from the engine seed and the request's index.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    logprobs: int | None = Field(None, ge=0, description="Top-k log-probabilities per token.")
    prompt_logprobs: int | None = Field(None, ge=0, description="Top-k per prompt position.")
    structured_output: StructuredOutput | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError(f"stop_token_ids must be >= 0, got {value}")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
