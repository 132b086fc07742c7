"""`compress_kv` for a decode step (one new token per sequence) as one Triton launch.

The reference op loops over the sequences on the host. In a decode step each sequence adds one
token, so every sequence has the same work: write the token's raw projections into its slot's
state and, only when the token closes its window, pool, normalise, rotate and write the entry
(`deepinfer_kernels.decode_compress`). The kernel reads the batch's device tensors only: no host
synchronisation, no shapes that depend on values, so the step can be captured in a graph.
"""

from __future__ import annotations

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.decode_compress import compress_decode_step

__all__ = ["compress_kv_decode", "is_decode_step"]


def is_decode_step(batch: ForwardBatch) -> bool:
    return all(n == 1 for n in batch.query_lens_cpu)


def compress_kv_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    inv_freq: torch.Tensor,
    ratio: int,
    overlap: bool,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    entries: torch.Tensor,
    batch: ForwardBatch,
) -> None:
    """`KernelOps.compress_kv` for a step whose sequences each bring one token (see `is_decode_step`)."""
    compress_decode_step(
        kv, gate, ape, norm_weight, norm_eps, inv_freq, ratio, overlap, state_kv, state_gate, entries,
        batch.slot_ids, batch.context_lens, batch.block_tables,
    )
