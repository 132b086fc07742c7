"""Row gather that reads the table where it lives: device memory, or pinned / registered host memory
read zero-copy over the bus (V4.1's engram tables, ~100 GB each, stay on the host).

The ids are read on the device, so a step whose ids come from the token in flight never waits for the
host; only the gathered rows cross the bus. Rows move as 32-bit words when their byte width allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["gather_rows"]

ROWS_PER_PROGRAM = 16


@triton.jit
def _gather_rows_kernel(
    table_ptr, ids_ptr, out_ptr, n, words, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    ids = tl.load(ids_ptr + rows, mask=live, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    ok = live[:, None] & (cols[None, :] < words)
    values = tl.load(table_ptr + ids[:, None] * words + cols[None, :], mask=ok)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * words + cols[None, :], values, mask=ok)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`KernelOps.gather_rows`: table [R, W] (contiguous; on the device, or host memory the device can
    address) and int64 ids [N] on the device -> [N, W] in table.dtype on ids' device."""
    width_bytes = table.shape[1] * table.element_size()
    word = torch.int32 if width_bytes % 4 == 0 else torch.uint8
    words = table.view(torch.uint8).view(word)
    out = torch.empty((ids.shape[0], words.shape[1]), dtype=word, device=ids.device)
    if ids.shape[0]:
        _gather_rows_kernel[(triton.cdiv(ids.shape[0], ROWS_PER_PROGRAM),)](
            words, ids, out, ids.shape[0], words.shape[1],
            ROWS=ROWS_PER_PROGRAM, BLOCK_W=triton.next_power_of_2(words.shape[1]), **launch_options(ids.device),
        )
    return out.view(torch.uint8).view(table.dtype)
