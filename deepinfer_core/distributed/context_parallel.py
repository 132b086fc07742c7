"""Context parallelism (CP): the rows of one step, e.g. a long prefill chunk, split over the ranks.

Every CP rank runs the same engine on the same batches and keeps a full copy of the cache; only the
model's row-wise work is shared out. `apply_context_parallel` installs a `ContextParallelRows` as the
model's `StepRows` hook. A step of T >= world_size rows is cut into contiguous shares of
floor(T / world_size) rows, one more for the first T % world_size ranks (never none, so no kernel sees
an empty batch); each rank runs its share through the embedding, every block (q projection, attention
of its queries, output projection, MoE, hyper-connection mixing) and the hyper-head. Per layer:
1. the rank computes the key-side rows of its share: the sliding-window kv and the raw projections of
   the compressor and of the CSA indexer's compressor (`StepRows.share_keys`);
2. one `all_gather` (shares padded to the largest) gives every rank every row of them, and every rank
   writes the whole step into its cache exactly as a single process does (`compress_kv` before the
   attention, `store_window` after it, with the step's batch), so the caches stay identical;
3. the rank's queries attend with a batch of its own rows (`begin`): a sequence cut by the share's
   start continues as a piece whose context includes the step's earlier rows. Compressed entries and
   indexer keys come from the cache, which step 2 completed. The piece's sliding window also needs
   those earlier rows, so they are written into its ring first: position p lands on the row of
   p - window, which no query of the piece reads, and `store_window` rewrites the whole step anyway.
   Only a share's first piece can start mid-sequence, so that is at most window - 1 rows a layer.
The output rows are all-gathered once, after the final norm, so every rank returns the whole step
(identical logits, and the streams the MTP block reads). Steps with fewer rows than ranks (decode of a
small batch) run replicated: every rank computes every row, no collective. MTP blocks always run
replicated.

Each row sees the single process's arithmetic (row-wise ops on fewer rows, attention over the same
keys in the same order), so results differ from it only by rounding that depends on an op's row count.
Supports DeepSeek-V4; V4.1's attention has no `StepRows` hook (see `apply_context_parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v4.step_rows import StepRows
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.interfaces import Communicator

from .ep_moe import ExpertParallelMoE
from .errors import ParallelConfigError

__all__ = ["ContextParallelRows", "apply_context_parallel"]


@dataclass(slots=True)
class _SharedStep:
    """One step as this rank runs it."""

    step: ForwardBatch
    rows: ForwardBatch               # this rank's rows, as their own batch
    share: int                       # the largest share: every rank pads its rows to it for all_gather
    gathered_rows: torch.Tensor      # [T] rows of the gathered padded shares that hold the step, in order
    cut_slot: int | None             # slot of the sequence the share's start cuts, if it cuts one
    cut_ring_rows: torch.Tensor      # its ring rows that must hold the step's earlier rows first ...
    cut_step_rows: torch.Tensor      # ... and those rows of the step


class ContextParallelRows(StepRows):
    def __init__(self, comm: Communicator, sliding_window: int) -> None:
        self.comm, self.sliding_window = comm, sliding_window
        self._shared: _SharedStep | None = None

    def begin(self, batch: ForwardBatch) -> ForwardBatch:
        world, total = self.comm.world_size, batch.num_tokens
        if total < world:
            self._shared = None
            return batch
        base, extra = divmod(total, world)
        sizes = [base + (r < extra) for r in range(world)]
        share, first = sizes[0], sum(sizes[: self.comm.rank])
        device = batch.input_ids.device
        gathered_rows = torch.cat([torch.arange(n, device=device) + r * share for r, n in enumerate(sizes)])
        self._shared = _share(batch, first, first + sizes[self.comm.rank], share, gathered_rows, self.sliding_window)
        return self._shared.rows

    def share_keys(
        self, keys: list[torch.Tensor], rows: ForwardBatch, window: torch.Tensor
    ) -> tuple[list[torch.Tensor], ForwardBatch]:
        shared = self._shared
        if shared is None:
            return keys, rows
        step_keys = list(self.gather(*keys))
        if shared.cut_slot is not None:
            window[shared.cut_slot, shared.cut_ring_rows] = step_keys[0][shared.cut_step_rows].to(window.dtype)
        return step_keys, shared.step

    def gather(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shared = self._shared
        if shared is None:
            return tensors
        flat = [t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in tensors]
        mine = torch.cat(flat, dim=1)
        padded = mine.new_zeros((shared.share, mine.shape[1]))
        padded[: mine.shape[0]] = mine
        every = self.comm.all_gather(padded)[shared.gathered_rows]
        widths = [f.shape[1] for f in flat]
        return tuple(
            part.reshape(part.shape[0], *t.shape[1:]).to(t.dtype).contiguous()
            for part, t in zip(every.split(widths, dim=1), tensors)
        )


def _share(
    batch: ForwardBatch, first: int, end: int, share: int, gathered_rows: torch.Tensor, sliding_window: int
) -> _SharedStep:
    """Rows [first, end) of `batch` as their own batch: a sequence whose step rows start before `first`
    continues from there, with those earlier rows counted as context."""
    device = batch.input_ids.device
    query_lens, context_lens, slots, tables, pieces = [], [], [], [], []
    cut_slot, cut_positions, cut_start = None, range(0), 0
    start = 0
    for i, (n_q, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
        lo, hi = max(first, start), min(end, start + n_q)
        if lo < hi:
            pieces.append(i)
            query_lens.append(hi - lo)
            context_lens.append(ctx + lo - start)
            slots.append(batch.slot_ids_cpu[i])
            tables.append(batch.block_tables_cpu[i])
            if lo > start:
                # The step's earlier rows that the piece's first query (position p0) still sees; one
                # ring row each, as they are fewer than the window.
                p0 = ctx + lo - start
                cut_slot, cut_start = batch.slot_ids_cpu[i], start - ctx
                cut_positions = range(max(ctx, p0 - sliding_window + 1), p0)
        start += n_q
    wanted = batch.logits_indices
    keep = (wanted >= first) & (wanted < end)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = ForwardBatch(
        input_ids=batch.input_ids[first:end],
        positions=batch.positions[first:end],
        query_start_loc=starts.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        slot_ids=torch.tensor(slots, dtype=torch.int32, device=device),
        block_tables=batch.block_tables[torch.tensor(pieces, dtype=torch.long, device=device)],
        logits_indices=wanted[keep] - first,
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        slot_ids_cpu=slots,
        block_tables_cpu=tables,
        window_starts_cpu=_pick(batch.window_starts_cpu, pieces),
        reused_lens_cpu=_pick(batch.reused_lens_cpu, pieces),
    )
    positions = torch.tensor(cut_positions, dtype=torch.long, device=device)
    return _SharedStep(batch, rows, share, gathered_rows, cut_slot, positions % sliding_window, positions + cut_start)


def _pick(per_sequence: list[int] | None, pieces: list[int]) -> list[int] | None:
    return None if per_sequence is None else [per_sequence[i] for i in pieces]


def apply_context_parallel(model: nn.Module, comm: Communicator) -> None:
    """Share each step's rows over the ranks of `comm` (see the module docstring), in place.

    Call on every rank after the weights are loaded; every rank must then run the same batches on its
    own full-size cache. With expert parallelism as well, build the MoE layers with
    `tokens_replicated=False`: CP gives each rank its own rows. A group of one leaves the model as it is.
    """
    if not isinstance(model, DeepseekV4ForCausalLM):
        raise ParallelConfigError(
            f"context parallelism supports DeepSeek-V4 (deepseek_v4) models, found {type(model).__name__}: "
            "V4.1's attention (shared band entries, KV quantisation, engram rows) has no StepRows hook "
            "to share a step's key rows yet; run it with cp=1"
        )
    replicated = [
        i for i, block in enumerate(model.layers)
        if isinstance(block.ffn, ExpertParallelMoE) and block.ffn.tokens_replicated
    ]
    if replicated:
        raise ParallelConfigError(
            f"layers {replicated} run expert parallelism with tokens_replicated=True, but under context "
            "parallelism each rank holds different rows: apply expert parallelism with tokens_replicated=False"
        )
    if comm.world_size == 1:
        return
    rows = ContextParallelRows(comm, model.config.sliding_window)
    model.step_rows = rows
    for block in model.layers:
        block.attn.step_rows = rows
