"""Where a step's sequences end, read inside a kernel from the batch's device tensors: computing it with
torch would cost each op two or three small launches a step (a subtraction, an addition, a division), each
a kernel boundary that programmatic dependent launch cannot overlap."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["sequence_end"]


@triton.jit
def sequence_end(query_start_ptr, context_lens_ptr, seq):
    """Sequence `seq`'s length after this step: its cached tokens plus its query rows (int32)."""
    rows = tl.load(query_start_ptr + seq + 1) - tl.load(query_start_ptr + seq)
    return tl.load(context_lens_ptr + seq) + rows
