"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Each step first serves running sequences in admission order (one token for a decode, the next
chunk for a prefill), then admits waiting ones while the token budget, the sequence limit and the
KV pool allow. When a running sequence cannot get the blocks it needs, the most recently admitted
running sequence is preempted: its cache is released and it waits to be prefilled again from all
of its known tokens (prompt and outputs so far), so nothing it generated is lost.

A request with n > 1 is prefilled once: its first sequence carries the others as `forks`; the
step that finishes the prompt also starts every fork (a copy of the prompt's cache state, and a
first token drawn from the same logits with the fork's own seed) while slots and blocks allow;
a fork that does not fit waits and is prefilled on its own.

With speculative decoding a decode sequence holding drafts is scheduled with its last token and
its drafts (they count against the token budget, and blocks are grown for every position);
only the last token counts as computed, and the engine adds the accepted drafts once verified.

A sequence with images is admitted only when its first chunk reaches the end of its last image span
(a waiting sequence starts from position 0), so no image span is split across steps; `LLM` refuses
prompts whose spans end beyond the token budget. Such a sequence never starts from a cached prefix.

Scheduling is optimistic: a scheduled token counts as computed at once, and a step that samples
appends a PENDING placeholder, so the next step can be scheduled before this one's tokens are
known (asynchronous scheduling).

With prefix caching (prefix_cache.py) a sequence admitted from scratch starts after the longest
cached prefix of its known tokens; in exact mode a prefill chunk ends at the sequence's snapshot
point so that the step leaves exactly that prefix's window state to copy. Blocks and snapshots a
round registers become reusable from the next round on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSeq", "Scheduler"]


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int              # first position computed this step (= tokens cached before it)
    num_tokens: int
    samples: bool           # the chunk reaches the sequence's last token: sample the next one
    forks: list[Sequence] = field(default_factory=list)  # siblings that copy its prompt state after the step
    draft: list[int] = field(default_factory=list)       # drafts verified after the last token (in num_tokens)
    restore_slot: int = -1    # exact prefix hit: copy this snapshot slot's state into the sequence's slot first
    snapshot_slot: int = -1   # copy the sequence's slot state here after the step
    prefix_hit: bool = False  # the sequence starts mid-prompt from cached blocks this step


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        forked: list[Sequence] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = self._chunk(seq, seq.num_computed_tokens, budget)
            if num_tokens == 0 or seq.num_tokens >= seq.max_num_tokens:
                index += 1  # nothing new to compute, or its in-flight token is its last
                continue
            draft = seq.draft_token_ids[:budget - num_tokens] if seq.num_uncomputed_tokens == 1 else []
            num_tokens += len(draft)
            while draft and not self.kv.can_hold(seq, seq.num_computed_tokens + num_tokens):
                draft.pop()  # verify fewer drafts before preempting anyone
                num_tokens -= 1
            while not self.kv.can_hold(seq, seq.num_computed_tokens + num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            scheduled.append(self._take(seq, num_tokens, forked, draft))
            budget -= num_tokens
            index += 1

        while (self.waiting and not preempted and budget > 0
               and len(self.running) + len(forked) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_pending:
                break
            # Image spans carry one token id whatever the image: a prefix match would mix images up.
            hit = self.kv.match_prefix(seq) if seq.images is None else None
            start = seq.num_computed_tokens if hit is None else hit.start
            num_tokens = min(seq.num_tokens - start, budget)
            if seq.images is not None and num_tokens < seq.images.end:
                break  # NOTE: image spans are prefilled whole, in the first chunk (MODEL_SPEC_V41 §11)
            if not self.kv.can_hold(seq, start + num_tokens, hit):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.kv.start_from(seq, hit)
            item = self._take(seq, self._chunk(seq, start, budget), forked)
            if hit is not None:
                item.prefix_hit, item.restore_slot = True, hit.snapshot_slot
            scheduled.append(item)
            budget -= item.num_tokens
        self.running.extend(forked)  # after the loops: a fork is never scheduled or preempted twice
        self.kv.commit()
        return scheduled

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give its cache back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.kv.release(seq)

    @staticmethod
    def _chunk(seq: Sequence, start: int, budget: int) -> int:
        """Tokens to compute from `start`: the rest within `budget`, ending at the snapshot point."""
        num_tokens = min(seq.num_tokens - start, budget)
        inside_images = seq.images is not None and seq.snapshot_at < seq.images.end
        if start < seq.snapshot_at < start + num_tokens and not inside_images:
            num_tokens = seq.snapshot_at - start
        return num_tokens

    def _take(
        self, seq: Sequence, num_tokens: int, forked: list[Sequence], draft: list[int] | None = None
    ) -> ScheduledSeq:
        start = seq.num_computed_tokens
        draft = draft or []
        self.kv.grow(seq, start + num_tokens)
        seq.num_computed_tokens += num_tokens - len(draft)
        samples = seq.num_computed_tokens == seq.num_tokens
        item = ScheduledSeq(seq, start, num_tokens, samples, draft=draft,
                            snapshot_slot=self.kv.computed(seq, start))
        if samples:
            seq.append_pending()
            if seq.forks:
                item.forks = self._start_forks(seq, forked)
        return item

    def _start_forks(self, parent: Sequence, forked: list[Sequence]) -> list[Sequence]:
        started = []
        for fork in parent.forks:
            fits = len(self.running) + len(forked) < self.config.max_num_seqs
            if fits and self.kv.can_hold(fork, parent.num_prompt_tokens):
                self.kv.grow(fork, parent.num_prompt_tokens)
                fork.num_computed_tokens = parent.num_prompt_tokens
                fork.status = SequenceStatus.RUNNING
                fork.append_pending()
                forked.append(fork)
                started.append(fork)
            else:
                self.waiting.append(fork)
        parent.forks = []
        return started

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.snapshot_at = seq.window_start = seq.reused_len = 0
        seq.set_draft([], None)  # re-prefilling rebuilds the drafter's caches and drafts anew
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
