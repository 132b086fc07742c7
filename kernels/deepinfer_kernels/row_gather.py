"""Row gather that reads the table where it lives: device memory, or pinned / registered host memory
read zero-copy over the bus (V4.1's engram tables, ~100 GB each, stay on the host).

The ids are read on the device, so a step whose ids come from the token in flight never waits for the
host; only the gathered rows cross the bus. Rows move as 32-bit words when their byte width allows.
The same launch is the NVIDIA backend's embedding, and writes each row several times over for the mHC
streams' start (`KernelOps.hc_embedding`): one Triton launch that takes part in PDL instead of torch's
gather and broadcast copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["gather_row_copies", "gather_rows"]

# A program moves at most TILE_WORDS words (16 rows of up to 256, down to 4 rows of 1,024 a program; wider
# rows take several programs): a 16-row tile of a 4,096-wide bf16 row (2,048 words) spilled 6 KB on sm_90.
ROWS_PER_PROGRAM, TILE_WORDS, MAX_BLOCK_WORDS = 16, 4096, 1024


@triton.jit
def _gather_rows_kernel(
    table_ptr, ids_ptr, out_ptr, n, words,
    COPIES: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    ids = tl.load(ids_ptr + rows, mask=live, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = live[:, None] & (cols[None, :] < words)
    values = tl.load(table_ptr + ids[:, None] * words + cols[None, :], mask=ok)
    for copy in tl.static_range(COPIES):
        tl.store(out_ptr + (rows[:, None].to(tl.int64) * COPIES + copy) * words + cols[None, :], values, mask=ok)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`KernelOps.gather_rows`: table [R, W] (contiguous; on the device, or host memory the device can
    address) and int64 ids [N] on the device -> [N, W] in table.dtype on ids' device."""
    return gather_row_copies(table, ids, 1)[:, 0]


def gather_row_copies(table: torch.Tensor, ids: torch.Tensor, copies: int) -> torch.Tensor:
    """`gather_rows` with each row written `copies` times: [N, copies, W]."""
    width_bytes = table.shape[1] * table.element_size()
    word = torch.int32 if width_bytes % 4 == 0 else torch.uint8
    words = table.view(torch.uint8).view(word)
    out = torch.empty((ids.shape[0], copies, words.shape[1]), dtype=word, device=ids.device)
    if ids.shape[0]:
        block_w = min(triton.next_power_of_2(words.shape[1]), MAX_BLOCK_WORDS)
        rows = min(ROWS_PER_PROGRAM, TILE_WORDS // block_w)
        _gather_rows_kernel[(triton.cdiv(ids.shape[0], rows), triton.cdiv(words.shape[1], block_w))](
            words, ids, out, ids.shape[0], words.shape[1], COPIES=copies, ROWS=rows, BLOCK_W=block_w,
            **launch_options(ids.device),
        )
    return out.view(torch.uint8).view(table.dtype)
