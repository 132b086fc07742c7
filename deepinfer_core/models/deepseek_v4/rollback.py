"""Undo the rejected tail of a multi-token step (speculative verification) in the decode state.

A step over positions ctx .. ctx+q-1 of a sequence changes two kinds of state (cache.py):
- per-slot rings (`window`, the compressors' and indexer's raw-projection rings `state_kv` /
  `state_gate`), where position p overwrites row p % span and with it position p - span;
- paged compressed entries and indexer keys.
When only positions < ctx + keep are accepted, the paged entries need nothing: an entry closed by a
rejected position is entry w >= (ctx + keep) // ratio, which no query reads before the step that
closes it again rewrites it (`compress_kv` emits before `sparse_attention` / `indexer_topk` read).
The rings do need undoing: a rejected position p > ctx + keep overwrote position p - span, which the
next step still reads (the window of its first query, or the open and previous compression windows
of CSA's overlap). `RingSnapshot` saves exactly the rows a step will write and puts back the rows of
its rejected positions; the rows of accepted positions keep what the step wrote.

NOTE: every ring must be at least as long as the step (q <= span): a longer step writes only its
last span positions, so the accepted positions before those would be lost. Snapshots check it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import LayerCache

__all__ = ["RingSnapshot", "StepTooLongForRing", "ring_tensors"]


class StepTooLongForRing(ValueError):
    """A step to be rolled back is longer than a ring it writes."""


def ring_tensors(layers: Sequence[LayerCache]) -> list[torch.Tensor]:
    """Every per-slot ring [num_slots, span, ...] of these layer caches (position p at row p % span)."""
    rings = []
    for layer in layers:
        rings.append(layer.window)
        for state in (layer.compressor, layer.indexer):
            if state is not None:
                rings += [state.state_kv, state.state_gate]
    return rings


@dataclass(slots=True)
class RingSnapshot:
    """The ring rows a step over positions starts[i] .. starts[i]+lengths[i]-1 of slot_ids[i] will write."""

    rings: list[torch.Tensor]
    sequences: torch.Tensor  # [R] int64, one row per (sequence, step position): the sequence index
    slots: torch.Tensor      # [R] int64
    positions: torch.Tensor  # [R] int64
    offsets: torch.Tensor    # [R] int64, index of the position inside its sequence's step
    saved: list[torch.Tensor]

    @classmethod
    def take(
        cls,
        rings: list[torch.Tensor],
        slot_ids: Sequence[int],
        starts: Sequence[int],
        lengths: Sequence[int],
    ) -> RingSnapshot:
        longest = max(lengths, default=0)
        for ring in rings:
            if longest > ring.shape[1]:
                raise StepTooLongForRing(
                    f"a step of {longest} tokens cannot be rolled back in a ring of {ring.shape[1]} rows; "
                    f"verify at most {ring.shape[1]} tokens per sequence (num_draft_tokens < {ring.shape[1]})"
                )
        device = rings[0].device if rings else torch.device("cpu")
        counts = torch.tensor(list(lengths), dtype=torch.long)
        sequences = torch.repeat_interleave(torch.arange(len(counts)), counts)
        offsets = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[sequences]
        positions = torch.tensor(list(starts), dtype=torch.long)[sequences] + offsets
        slots = torch.tensor(list(slot_ids), dtype=torch.long)[sequences]
        sequences, slots, positions, offsets = (t.to(device) for t in (sequences, slots, positions, offsets))
        saved = [ring[slots, positions % ring.shape[1]].clone() for ring in rings]
        return cls(rings, sequences, slots, positions, offsets, saved)

    def restore(self, kept: torch.Tensor) -> None:
        """Put back the rows of every position at or after kept[i] tokens into sequence i's step.

        kept: [S] int64 (device or host), accepted positions per sequence, 0 <= kept[i] <= lengths[i].
        Mutates the rings; nothing is synchronised with the host.
        """
        rejected = self.offsets >= kept.to(self.offsets.device, torch.long)[self.sequences]
        for ring, saved in zip(self.rings, self.saved):
            rows = self.positions % ring.shape[1]
            current = ring[self.slots, rows]
            ring[self.slots, rows] = torch.where(_broadcast(rejected, saved), saved, current)


def _broadcast(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))
