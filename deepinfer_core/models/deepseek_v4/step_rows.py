"""Which rows of a step this process computes: all of them, unless context parallelism shares them out."""

from __future__ import annotations

import torch

from deepinfer_core.models.forward_batch import ForwardBatch

__all__ = ["StepRows"]


class StepRows:
    """The model's hook for splitting a step's rows over processes; this base computes every row here.

    Context parallelism (`deepinfer_core.distributed.context_parallel`) replaces it: each rank then runs
    its own contiguous rows through every row-wise part of the model, while the rows that the cache
    writes need (`share_keys`) are exchanged so that every rank's cache takes the whole step.
    """

    def begin(self, batch: ForwardBatch) -> ForwardBatch:
        """The rows this process runs of the step `batch`; called once at the start of each forward."""
        return batch

    def share_keys(
        self, keys: list[torch.Tensor], rows: ForwardBatch, window: torch.Tensor
    ) -> tuple[list[torch.Tensor], ForwardBatch]:
        """One layer's key-side rows ([rows, P_k] each, this process's rows as `begin` returned them) ->
        (every row of the step of each, the step's batch), for the cache writes. Before the step's
        `store_window`, the sliding-window ring `window` must hold what `rows`' queries read."""
        return keys, rows

    def gather(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This process's rows of each tensor -> every row of the step, in row order."""
        return tensors
