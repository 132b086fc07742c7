"""What the engine hands a model for one step: a flat, unpadded batch of tokens plus per-sequence
metadata that points into the paged cache.

Layout of one step with S sequences and T = sum(query_lens) tokens:
- sequence i owns rows query_start_loc[i] : query_start_loc[i+1] of `input_ids` / `positions`;
- those rows are the tokens at absolute positions context_lens[i] .. context_lens[i]+query_lens[i]-1
  (a prefill chunk, a whole prompt, or one decode token);
- context_lens[i] tokens of that sequence are already in the cache (0 for a fresh prefill);
- slot_ids[i] names the sequence's fixed-size state (sliding windows, open compression windows);
- block_tables[i] lists the cache blocks (block_size tokens each) that hold its growing state
  (compressed entries, indexer keys), padded with -1.
- window_starts_cpu / reused_lens_cpu (optional, bounded prefix replay): a sequence that recomputes the
  tail of a reused prefix attends no window KV below window_starts[i] and leaves the cached compressed
  entries and indexer keys of positions below reused_lens[i] as they are.

Device tensors feed the kernels; the `_cpu` lists are the same numbers on the host, for ops that
plan on the host (the reference ops loop over sequences) without a device sync. A step captured in a
device graph has no per-sequence host values (they change at every replay): only `query_lens_cpu` (all
ones in a decode step) and `max_seq_len` are there, and reading the other lists raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ForwardBatch", "NotOnHost"]


_CAPTURED = ("while a decode step was captured in a device graph, where those host values change at every replay; "
             "size the work from `max_seq_len` and the device tensors, or run this model with enforce_eager=True")


class NotOnHost(Sequence):
    """A per-sequence host list that the host does not hold (a step captured in a device graph, whose
    values change at every replay; or a table built on the device): its length is known, reading it raises."""

    def __init__(self, length: int, name: str, why: str = _CAPTURED) -> None:
        self._length, self._name, self._why = length, name, why

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        raise RuntimeError(f"an op read ForwardBatch.{self._name} {self._why}")


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64, absolute positions
    query_start_loc: torch.Tensor  # [S+1] int32, cumulative query lengths
    context_lens: torch.Tensor     # [S] int32, tokens cached before this step
    slot_ids: torch.Tensor         # [S] int32
    block_tables: torch.Tensor     # [S, max_blocks] int32, -1 padded
    logits_indices: torch.Tensor   # [N] int64, rows of T whose logits are wanted
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    slot_ids_cpu: list[int]
    block_tables_cpu: list[list[int]]
    # Prefix reuse with bounded replay (engine/prefix_cache.py), per sequence; None = all zeros:
    window_starts_cpu: list[int] | None = None  # no window KV exists below this position (ring rows ignored)
    reused_lens_cpu: list[int] | None = None    # compressed entries of positions below this are cached: keep them
    # Device-graph capture (engine/decode_graphs.py): a bound on context_len + query_len of every sequence
    # at every replay. Ops that size work from the host lists size it from this instead; None = exact sizes.
    max_seq_len: int | None = None
    # row -> sequence index, built on first use (`row_sequences`); not copied by dataclasses.replace
    _row_sequences: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def row_sequences(self) -> torch.Tensor:
        """[T] int64: the sequence index of every row, built once per step on the device (every layer's
        attention, window store and compressor ask for it)."""
        if self._row_sequences is not None:
            return self._row_sequences
        sequences = torch.arange(self.num_seqs, device=self.query_start_loc.device)
        if any(n != 1 for n in self.query_lens_cpu):  # one token a sequence needs no scan: row i is sequence i
            counts = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
            sequences = torch.repeat_interleave(sequences, counts, output_size=self.num_tokens)
        self._row_sequences = sequences
        return sequences

    @property
    def is_plain_decode(self) -> bool:
        """One token a sequence and no bounded prefix replay: the steps a device graph replays, which the
        DeepSeek-V4.1 layers run over all sequences at once instead of planning each on the host."""
        return self.num_tokens == self.num_seqs and self.window_starts_cpu is None and self.reused_lens_cpu is None

    @property
    def seq_len_bound(self) -> int:
        """A bound on context_len + query_len of every sequence: `max_seq_len` in a captured step, else the
        longest sequence's, from the host lists."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return max((c + n for c, n in zip(self.context_lens_cpu, self.query_lens_cpu)), default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
