"""Acceptance accounting of speculative decoding.

Counted in output tokens that were really emitted: a verification step emits its accepted drafts
plus one target token, so `tokens_per_step` is 1 with no drafts and k + 1 at full acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpeculativeStats"]


@dataclass(slots=True)
class SpeculativeStats:
    steps: int = 0              # sequence-steps: one per sequence per verification step
    drafted: list[int] = field(default_factory=list)   # [j]: drafts verified at draft position j
    accepted: list[int] = field(default_factory=list)  # [j]: drafts accepted at draft position j

    def record(self, draft_lengths: list[int], num_accepted: list[int]) -> None:
        for verified, kept in zip(draft_lengths, num_accepted):
            self.steps += 1
            width = max(verified, len(self.drafted))
            self.drafted += [0] * (width - len(self.drafted))
            self.accepted += [0] * (width - len(self.accepted))
            for j in range(verified):
                self.drafted[j] += 1
                self.accepted[j] += j < kept

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def mean_accepted_drafts(self) -> float:
        return self.num_accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Emitted output tokens per sequence-step: accepted drafts + the target's own token."""
        return 1.0 + self.mean_accepted_drafts if self.steps else 0.0
