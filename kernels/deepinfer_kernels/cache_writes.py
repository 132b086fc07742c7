"""Writes of a step's rows into the per-slot sliding-window rings, one program per row, no host sync."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid
from deepinfer_kernels.step_layout import sequence_end

__all__ = ["store_window"]


@triton.jit
def _store_window_kernel(
    kv_ptr, window_ptr, pos_ptr, row_seq_ptr, slot_ptr, query_start_ptr, context_lens_ptr, ring, D, stride_slot,
    stride_ring,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    row = tl.program_id(0)
    seq = tl.load(row_seq_ptr + row)
    pos = tl.load(pos_ptr + row)
    # only a sequence's last `ring` positions of the step reach the ring (earlier ones would be overwritten)
    if pos >= sequence_end(query_start_ptr, context_lens_ptr, seq) - ring:
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        target = tl.load(slot_ptr + seq).to(tl.int64) * stride_slot + (pos % ring) * stride_ring
        value = tl.load(kv_ptr + row.to(tl.int64) * D + cols, mask=ok)
        tl.store(window_ptr + target + cols, value.to(window_ptr.dtype.element_ty), mask=ok)


def store_window(kv: torch.Tensor, window: torch.Tensor, batch: ForwardBatch) -> None:
    """`KernelOps.store_window`: kv [T, d] into window [num_slots, W, d] at (slot, position % W)."""
    t, d = kv.shape
    if t == 0:
        return
    _store_window_kernel[(t,)](
        kv.contiguous(), window, batch.positions, batch.row_sequences(), batch.slot_ids, batch.query_start_loc,
        batch.context_lens, window.shape[1], d, window.stride(0), window.stride(1), BLOCK_D=triton.next_power_of_2(d),
        **launch_options(kv.device),
    )
