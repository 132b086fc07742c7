"""`compress_kv` for a decode step (one new token per sequence) as a fixed set of batched tensor ops.

The reference op loops over the sequences on the host. In a decode step each sequence adds one
token, so every sequence has the same work: write the token's raw projections into its slot's
state, then pool the window the token belongs to. The pooled entry is written only for sequences
whose token closes its window; for the others the entry's slot (inside a block the sequence already
holds) gets its own value back. No host synchronisation, no shapes that depend on values.
"""

from __future__ import annotations

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, pool_gated_windows

__all__ = ["compress_kv_decode", "is_decode_step"]


def is_decode_step(batch: ForwardBatch) -> bool:
    return all(n == 1 for n in batch.query_lens_cpu)


def compress_kv_decode(
    ops: KernelOps,
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
    span, width = state_kv.shape[1], entries.shape[-1]
    block_size = ratio * entries.shape[1]
    slots, ctx = batch.slot_ids.long(), batch.context_lens.long()
    # The token joins the state first: the window it closes spans at most `span` positions, all
    # distinct modulo span, so reading them all from the state equals the reference's concatenation.
    state_kv[slots, ctx % span] = kv.to(state_kv.dtype)
    state_gate[slots, ctx % span] = gate.to(state_gate.dtype)
    window = ctx // ratio
    own = window[:, None] * ratio + torch.arange(ratio, device=kv.device)[None, :]

    def in_state(state: torch.Tensor):
        return lambda positions: state[slots[:, None], positions % span]

    pooled = pool_gated_windows(in_state(state_kv), in_state(state_gate), own, window > 0, ape, ratio, overlap, width)
    pooled = ops.rms_norm(pooled, norm_weight, norm_eps)
    pooled = ops.rope(pooled, window * ratio, inv_freq).to(entries.dtype)
    rows = torch.arange(slots.shape[0], device=kv.device)
    blocks = batch.block_tables[rows, (window * ratio) // block_size].long()
    offsets = ((window * ratio) % block_size) // ratio
    closes = ((ctx + 1) % ratio == 0)[:, None]
    entries[blocks, offsets] = torch.where(closes, pooled, entries[blocks, offsets])
