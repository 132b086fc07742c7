"""Decode steps replayed from device graphs: one captured forward per (padded batch size, context bound).

A decode step of the V4-Flash slice launches about 700 kernels; launched one at a time from Python, the
host, not the device, sets the step time. A replayed graph launches them all at once. A step is
capturable because:
- every tensor it reads keeps its address: the step's inputs are copied into static buffers;
- nothing in it is sized from host values that change between steps: the batch is padded to a captured
  size, and ops that size work from context lengths use `ForwardBatch.max_seq_len` (a power of two at or
  above the longest sequence) instead. During capture the per-sequence host lists are `NotOnHost`, so an
  op that still reads them fails the capture instead of baking one step's values into every replay;
- padding rows do real work, on a spare slot and a spare block that no sequence owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.models.forward_batch import ForwardBatch, NotOnHost
from deepinfer_core.platform.interfaces import DeviceGraph, MemoryManager

__all__ = ["CAPTURE_BATCH_SIZES", "DecodeGraphs"]

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_SEQ_BOUND = 256  # the smallest context bound: fewer graphs for short contexts


@dataclass(slots=True)
class _Captured:
    inputs: ForwardBatch  # the static buffers the graph reads
    graph: DeviceGraph    # output: float32 logits [padded batch, vocab]


class DecodeGraphs:
    """Captures lazily (the first step of each batch size and bound) and replays.

    The captured step is `model`'s forward over `cache` and its logits for `batch.logits_indices`. The
    spare slot and block must exist in the cache and never be handed out.
    """

    def __init__(
        self,
        model: Any,
        cache: Any,
        memory: MemoryManager,
        device: torch.device,
        *,
        spare_slot: int,
        spare_block: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model, self.cache, self.memory, self.device = model, cache, memory, device
        self.spare_slot, self.spare_block, self.block_size = spare_slot, spare_block, block_size
        self.sizes = [s for s in CAPTURE_BATCH_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.max_model_len = max_model_len
        self._captured: dict[tuple[int, int], _Captured] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._captured)

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a decode step a graph can run: one token a sequence, no bounded replay,
        a logits row per sequence in order, no more sequences than the largest size."""
        n = batch.num_seqs
        return 0 < n <= self.sizes[-1] and batch.is_plain_decode and batch.logits_indices.shape[0] == n

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [num_seqs, vocab], from a replay (captured first if this shape is new)."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        bound = self._bound(max(batch.context_lens_cpu) + 1)
        captured = self._captured.get((size, bound))
        if captured is None:
            captured = self._captured[size, bound] = self._capture(size, bound)
        self._load(captured.inputs, batch)
        captured.graph.replay()
        return captured.graph.output[:n]

    def _bound(self, longest: int) -> int:
        bound = max(MIN_SEQ_BOUND, 1 << (longest - 1).bit_length())
        return max(longest, min(bound, self.max_model_len))

    def _capture(self, size: int, bound: int) -> _Captured:
        width = -(-bound // self.block_size)
        i32, i64 = {"dtype": torch.int32, "device": self.device}, {"dtype": torch.int64, "device": self.device}
        inputs = ForwardBatch(
            input_ids=torch.zeros(size, **i64),
            positions=torch.zeros(size, **i64),
            query_start_loc=torch.arange(size + 1, **i32),
            context_lens=torch.zeros(size, **i32),
            slot_ids=torch.full((size,), self.spare_slot, **i32),
            block_tables=torch.full((size, width), self.spare_block, **i32),
            logits_indices=torch.arange(size, **i64),
            query_lens_cpu=[1] * size,
            context_lens_cpu=NotOnHost(size, "context_lens_cpu"),
            slot_ids_cpu=NotOnHost(size, "slot_ids_cpu"),
            block_tables_cpu=NotOnHost(size, "block_tables_cpu"),
            max_seq_len=bound,
        )
        # Warm-up and capture run on the padding values: only the spare slot and block change. A memo the
        # warm-up leaves on `inputs` (row_sequences) depends only on query_start_loc, fixed for the graph.
        return _Captured(inputs, self.memory.capture_graph(lambda: self._step_logits(inputs)))

    def _step_logits(self, batch: ForwardBatch) -> torch.Tensor:
        # A plain decode step's logits rows are all its rows in order (`covers`): no gather of the hidden rows.
        return self.model.compute_logits(self.model.forward(batch, self.cache).hidden)

    def _load(self, inputs: ForwardBatch, batch: ForwardBatch) -> None:
        """Copy the step into the static buffers; rows past it become padding again."""
        n = batch.num_seqs
        columns = min(batch.block_tables.shape[1], inputs.block_tables.shape[1])  # blocks past the bound hold nothing read
        for static, value, pad in (
            (inputs.input_ids, batch.input_ids, 0),
            (inputs.positions, batch.positions, 0),
            (inputs.context_lens, batch.context_lens, 0),
            (inputs.slot_ids, batch.slot_ids, self.spare_slot),
        ):
            static[:n].copy_(value)
            static[n:].fill_(pad)
        inputs.block_tables.fill_(self.spare_block)
        inputs.block_tables[:n, :columns].copy_(batch.block_tables[:, :columns])

