"""Token bitmasks of grammar-constrained logits rows: filled on the host, applied on the device.

A bitmask row is ceil(vocab_size / 32) int32 words; bit t (word t // 32, bit t % 32) set means
token t is allowed. This is xgrammar's layout, so its matchers fill the rows directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from deepinfer_core.engine.grammar import GrammarMatcher

__all__ = ["GrammarBitmask", "apply_token_bitmask", "bitmask_width"]

HostBufferFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None
) -> None:
    """Set to -inf, in place, every logit whose token the bitmask forbids.

    logits: [N, V] floating, any device. bitmask: [R, ceil(V' / 32)] int32, any device (copied to
    the logits' device when elsewhere). rows: R row indices into logits, bitmask[k] masking
    logits[rows[k]]; None means R == N, row for row. Rows not named are untouched. Columns past
    the bitmask's width (V > 32 * width) are forbidden in masked rows: no grammar allows an id
    without a token. Exact (a select, no arithmetic).
    """
    device = logits.device
    if bitmask.device != device:
        bitmask = bitmask.to(device, non_blocking=True)
    vocab = logits.shape[-1]
    # NOTE: little-endian byte view: token t is bit t % 8 of byte t // 8, on every supported device.
    packed = bitmask.contiguous().view(torch.uint8)
    byte_values = torch.arange(256, device=device)
    bits_of_byte = ((byte_values[:, None] >> torch.arange(8, device=device)) & 1).bool()  # [256, 8]
    allowed = bits_of_byte.index_select(0, packed.flatten().int()).view(packed.shape[0], -1)
    if allowed.shape[-1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    if not isinstance(rows, torch.Tensor):
        rows = torch.tensor(rows, dtype=torch.long)
    rows = rows.to(device, non_blocking=True)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarBitmask:
    """Host staging for one engine's grammar masks, filled by the CPU and applied just before
    sampling, without a host-device synchronisation.

    Each `fill` writes the constrained rows compactly (mask and logits-row index) into one of two
    host buffers, taken in turn; `apply` copies that buffer to the logits' device asynchronously
    and masks those rows. Pass `host_buffer=memory.pinned_buffer` of the backend's MemoryManager
    so the copies are truly asynchronous.
    """

    def __init__(self, vocab_size: int, max_rows: int, *, host_buffer: HostBufferFactory = _host_tensor) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        width = bitmask_width(vocab_size)
        # NOTE: two buffers because step N+1's fill may run while step N's copy is still queued on
        # the device; fill N+2 reuses step N's buffer only after the CPU has waited for step N+1's
        # sampled tokens (it needs them to advance the matchers), so that copy has completed.
        self._masks = [host_buffer((max_rows, width), xgr.bitmask_dtype) for _ in range(2)]
        self._rows = [host_buffer((max_rows,), torch.long) for _ in range(2)]
        self._turn = 0
        self._num_constrained = 0
        self._batch_filler = xgr.BatchGrammarMatcher()

    def fill(
        self,
        matchers: Sequence[GrammarMatcher | None],
        draft_token_ids: Sequence[list[int]] | None = None,
    ) -> int:
        """Compute the masks of the next step's logits rows; returns how many rows are constrained.

        Without drafts, matchers[i] owns logits row i. With drafts (speculative verification),
        matchers[i] owns len(draft_token_ids[i]) + 1 consecutive rows, in order. None (an
        unconstrained sample) and terminated matchers leave their rows unmasked. Matchers must
        already have accepted every token sampled before this step.
        """
        self._turn ^= 1
        masks, rows = self._masks[self._turn], self._rows[self._turn]
        constrained: list[GrammarMatcher] = []
        row_indices: list[int] = []
        slot = 0
        logits_row = 0
        for index, matcher in enumerate(matchers):
            num_rows = 1 if draft_token_ids is None else len(draft_token_ids[index]) + 1
            if matcher is not None and not matcher.is_terminated():
                if slot + num_rows > self.max_rows:
                    raise ValueError(
                        f"GrammarBitmask holds {self.max_rows} constrained rows but this step needs "
                        "more; size max_rows for max_num_seqs * (1 + speculative tokens)"
                    )
                row_indices.extend(range(logits_row, logits_row + num_rows))
                if draft_token_ids is None:
                    constrained.append(matcher)
                else:
                    matcher.fill_draft_bitmasks(draft_token_ids[index], masks, slot)
                slot += num_rows
            logits_row += num_rows
        rows[:slot] = torch.tensor(row_indices, dtype=torch.long)
        if constrained:
            self._batch_filler.batch_fill_next_token_bitmask(
                [matcher.xgrammar_matcher for matcher in constrained], masks
            )
        self._num_constrained = slot
        return slot

    def apply(self, logits: torch.Tensor) -> None:
        """Mask `logits` [N, vocab] (on the device) in place with the last `fill`; a no-op if
        nothing was constrained. Logprobs of the raw distribution must come from unmasked logits."""
        count = self._num_constrained
        if count == 0:
            return
        masks = self._masks[self._turn][:count]
        rows = self._rows[self._turn][:count]
        apply_token_bitmask(logits, masks, rows)
