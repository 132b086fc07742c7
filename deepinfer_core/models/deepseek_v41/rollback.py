"""Undo the rejected tail of a multi-token step (speculative verification) in a `DeepseekV41Cache`.

A step over positions ctx .. ctx+q-1 of a sequence, of which the first `kept` are accepted, leaves
three kinds of state wrong (cache.py):
- the window rings: a rejected position p overwrote row p % W, which held p - W; RingSnapshot
  (V4's rollback.py) saves the rows the step writes and puts back those of rejected positions;
- the open group of each pooled band (ratio r > 1): after the accepted end e = ctx + kept it must hold
  the raw projections of positions r*(e//r) .. e-1. Those before ctx come from the open rows saved
  before the step; those inside the step are recomputed from the compressor's input of the step,
  which `take` records;
- the engram look-back: the compressed ids of the last N-1 accepted tokens, from the tokens the
  caller passes to `restore`.
Paged entries and indexer keys need nothing: an entry closed by a rejected position has id
>= e // r, and the step that closes it again rewrites it before any query reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.models.deepseek_v4.rollback import RingSnapshot
from deepinfer_core.models.forward_batch import ForwardBatch

from .cache import DeepseekV41Cache
from .model import DeepseekV41ForCausalLM

__all__ = ["StepRollback", "StepSnapshot"]


class StepRollback:
    """Takes a snapshot before a step (`take`) that can restore the accepted positions afterwards.

    `lookback`: how many of a sequence's last accepted tokens `StepSnapshot.restore` needs (0 without
    engram layers)."""

    def __init__(self, model: DeepseekV41ForCausalLM, cache: DeepseekV41Cache) -> None:
        c = model.config.text_config
        self.model, self.cache = model, cache
        self.rings = [part for window in cache.windows for part in window.parts]
        self.pooled = {source: model.layers[source].attn.compressor
                       for source, ratio in c.band_ratios.items() if ratio > 1}
        self.lookback = c.engram_max_ngram_size - 1 if c.engram_layer_ids else 0
        self.inputs: dict[int, torch.Tensor] | None = None
        # NOTE: the compressor keeps only the step's last open group; the open group after a rejection
        # may start earlier, so its input rows are recorded while a snapshot is pending.
        for source, compressor in self.pooled.items():
            compressor.register_forward_pre_hook(self._recorder(source))

    def _recorder(self, source: int):
        def record(module, args) -> None:
            if self.inputs is not None:
                self.inputs[source] = args[0]
        return record

    def take(self, batch: ForwardBatch, lengths: Sequence[int]) -> StepSnapshot:
        """Before a step over `batch`; lengths[i]: rows of sequence i that may be rolled back (0 = none)."""
        rings = RingSnapshot.take(self.rings, batch.slot_ids_cpu, batch.context_lens_cpu, lengths)
        slots = torch.tensor(batch.slot_ids_cpu, dtype=torch.long, device=self.rings[0].device)
        open_rows = {}
        for source in self.pooled:
            band = self.cache.bands[source]
            open_rows[source] = (band.open_kv[slots].clone(), band.open_gate[slots].clone())
        self.inputs = {}
        return StepSnapshot(self, batch, list(lengths), rings, open_rows)


@dataclass(slots=True)
class StepSnapshot:
    owner: StepRollback
    batch: ForwardBatch
    lengths: list[int]
    rings: RingSnapshot
    open_rows: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def restore(self, kept: torch.Tensor, tails: Sequence[Sequence[int]] = ()) -> None:
        """kept: [S] accepted positions per sequence (0 <= kept[i] <= lengths[i]); tails[i]: sequence i's
        last `owner.lookback` tokens up to and including its last accepted one (fewer at its start),
        needed for the sequences that rejected something."""
        owner = self.owner
        inputs, owner.inputs = owner.inputs or {}, None
        self.rings.restore(kept)
        kept_cpu = kept.tolist()
        rejected = [i for i, (n, k) in enumerate(zip(self.lengths, kept_cpu)) if k < n]
        if not rejected:
            return
        for source, compressor in owner.pooled.items():
            self._restore_open_group(source, compressor, inputs[source], rejected, kept_cpu)
        if owner.lookback:
            self._restore_lookback(rejected, tails)

    def _restore_open_group(self, source: int, compressor, x: torch.Tensor, rejected: list[int], kept: list[int]):
        batch, band = self.batch, self.owner.cache.bands[source]
        kv, gate = compressor.projections(x.float())
        saved_kv, saved_gate = self.open_rows[source]
        r = band.ratio
        starts = [0] + torch.tensor(batch.query_lens_cpu).cumsum(0).tolist()[:-1]
        for i in rejected:
            ctx, slot = batch.context_lens_cpu[i], batch.slot_ids_cpu[i]
            end = ctx + kept[i]
            for p in range(r * (end // r), end):
                if p < ctx:
                    band.open_kv[slot, p % r] = saved_kv[i, p % r]
                    band.open_gate[slot, p % r] = saved_gate[i, p % r]
                else:
                    band.open_kv[slot, p % r] = kv[starts[i] + p - ctx]
                    band.open_gate[slot, p % r] = gate[starts[i] + p - ctx]

    def _restore_lookback(self, rejected: list[int], tails: Sequence[Sequence[int]]) -> None:
        owner = self.owner
        for i in rejected:
            lookback = owner.model.hasher.lookback(tails[i])
            owner.cache.engram_history[self.batch.slot_ids_cpu[i]].copy_(lookback, non_blocking=True)
