"""One sequence being generated: its tokens, its place in the cache, and its scheduling state.

A request with n > 1 owns n sequences. Token ids the device sampled but the host has not yet
read are held as `PENDING` placeholders (asynchronous scheduling learns them one step late).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.outputs import Logprobs
from deepinfer_core.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from deepinfer_core.engine.grammar import GrammarMatcher, PendingGrammar
    from deepinfer_core.engine.images import PromptImages

__all__ = ["PENDING", "SequenceStatus", "Sequence"]

PENDING = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: int
    index: int                       # which of the request's n completions
    token_ids: list[int]             # prompt, then outputs (PENDING while in flight)
    num_prompt_tokens: int
    max_num_tokens: int              # prompt + max_tokens, capped by the model's context
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0     # tokens whose state is (or will be, once in flight steps end) cached
    num_pending: int = 0
    slot_id: int = -1
    block_table: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    pending_grammar: PendingGrammar | None = None   # compiling; becomes `grammar` when first sampled
    grammar: GrammarMatcher | None = None
    forks: list[Sequence] = field(default_factory=list)  # n > 1: siblings that copy this prompt's state
    draft_token_ids: list[int] = field(default_factory=list)  # speculative: drafts to verify next step
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), V]: what they were drawn from (device)
    num_draft_tokens: int = 0        # speculative: drafts verified so far
    num_accepted_tokens: int = 0     # speculative: of those, accepted by the target
    images: PromptImages | None = None  # V4.1: the prompt's image spans and their vectors
    # Prefix caching (prefix_cache.py), set when the sequence is admitted:
    block_names: list[bytes] = field(default_factory=list)  # chained names of its known tokens' full blocks
    snapshot_at: int = 0             # exact mode: snapshot the slot state when computed reaches it; 0 = none
    window_start: int = 0            # bounded replay: no window KV below this position
    reused_len: int = 0              # bounded replay: the cached entries below this position are kept

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt position still lacks its prompt logprobs."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the sequence finished before they were needed)."""
        del self.token_ids[self.num_tokens - self.num_pending:]
        self.num_pending = 0

    def set_draft(self, token_ids: list[int], probs: torch.Tensor | None) -> None:
        self.draft_token_ids, self.draft_probs = token_ids, probs

    def append_accepted(self, token_id: int) -> None:
        """Add a token after an accepted draft: the draft's position is already cached."""
        self.token_ids.append(token_id)
        self.num_computed_tokens += 1

    def resolve_pending(self, token_id: int) -> None:
        """Replace the oldest in-flight placeholder with the token the device sampled."""
        position = self.num_tokens - self.num_pending
        self.token_ids[position] = token_id
        self.num_pending -= 1
