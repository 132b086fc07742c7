"""Where paged cache entries lie, one launch each:
- `KernelOps.paged_rows`, the flat vector ids of entries. The reference clamps the ids, divides them, gathers their
  blocks from the tables, multiplies and adds: six or seven torch kernels, each a kernel boundary that programmatic
  dependent launch cannot overlap, and DeepSeek-V4.1's decode step asks for such ids for every pick of an index
  source, every read of its index keys and every write of a compressed entry;
- `KernelOps.selection_tables`, the tables that find a decode step's picked entries (four or five torch kernels
  for each index source's picks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import launch_options, wait_for_previous_grid

__all__ = ["paged_rows", "selection_tables"]

_MAX_BLOCK = 1024


@triton.jit
def _paged_rows_kernel(
    tables_ptr, ids_ptr, out_ptr, width, k, stride_table, stride_ids_s, stride_ids_k, PER_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    seq = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < k
    ids = tl.maximum(tl.load(ids_ptr + seq * stride_ids_s + j * stride_ids_k, mask=ok, other=0).to(tl.int64), 0)
    column = ids // PER_BLOCK
    block = tl.load(tables_ptr + seq * stride_table + column, mask=ok & (column < width), other=0).to(tl.int64)
    tl.store(out_ptr + seq * k + j, tl.maximum(block, 0) * PER_BLOCK + ids % PER_BLOCK, mask=ok)


def paged_rows(block_tables: torch.Tensor, ids: torch.Tensor, per_block: int) -> torch.Tensor:
    """`KernelOps.paged_rows`: block_tables [S, W], ids [S, k] -> int64 [S, k]."""
    seqs, k = ids.shape
    out = torch.empty((seqs, k), dtype=torch.long, device=ids.device)
    if seqs and k:
        tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        block = min(_MAX_BLOCK, triton.next_power_of_2(k))
        _paged_rows_kernel[(seqs, triton.cdiv(k, block))](
            tables, ids, out, tables.shape[1], k, tables.stride(0), ids.stride(0), ids.stride(1), PER_BLOCK=per_block,
            BLOCK=block, **launch_options(ids.device),
        )
    return out


@triton.jit
def _selection_tables_kernel(
    selected_ptr, tables_ptr, n_seqs, k, columns, stride_selected, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_grid(PDL)
    seq = tl.program_id(0).to(tl.int64)
    row = tables_ptr + seq * columns
    for c0 in range(0, columns, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        tl.store(row + c, (n_seqs * k).to(tl.int32), mask=c < columns)
    tl.debug_barrier()  # every thread's fill lands before any pick overwrites it
    for j0 in range(0, k, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        ids = tl.load(selected_ptr + seq * stride_selected + j, mask=j < k, other=-1).to(tl.int64)
        tl.store(row + ids, (seq * k + j).to(tl.int32), mask=(j < k) & (ids >= 0) & (ids < columns - 1))


def selection_tables(selected: torch.Tensor, n_entries: int) -> torch.Tensor:
    """`KernelOps.selection_tables`: selected [S, k] -> int32 tables [S, n_entries + 1]."""
    n_seqs, k = selected.shape
    tables = torch.empty((n_seqs, n_entries + 1), dtype=torch.int32, device=selected.device)
    if n_seqs:
        _selection_tables_kernel[(n_seqs,)](
            selected, tables, n_seqs, k, n_entries + 1, selected.stride(0),
            BLOCK_C=min(_MAX_BLOCK, triton.next_power_of_2(n_entries + 1)),
            BLOCK_K=min(_MAX_BLOCK, triton.next_power_of_2(max(k, 1))), **launch_options(selected.device),
        )
    return tables
