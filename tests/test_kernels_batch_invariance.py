"""The nvidia kernels' batch-invariant mode through Triton's interpreter: a sequence prefilled in one
chunk or in two gives bitwise the same attention output (window key blocks aligned to the query),
and a linear row is the same in any row count (one tile config)."""

from __future__ import annotations

import pytest
import torch
import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels import)
from deepinfer_kernels.linear import linear
from deepinfer_kernels.sparse_attention import sparse_attention

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

RING, HEADS, DIM = 48, 4, 32


def _one_sequence(query_len: int, context_len: int) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.zeros(query_len, dtype=torch.long),
        positions=torch.arange(context_len, context_len + query_len),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        context_lens=torch.tensor([context_len], dtype=torch.int32),
        slot_ids=torch.tensor([0], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        logits_indices=torch.tensor([query_len - 1]),
        query_lens_cpu=[query_len], context_lens_cpu=[context_len], slot_ids_cpu=[0], block_tables_cpu=[[0]],
    )


def _chunked_attention(q, kv, sinks, split: int, invariant: bool) -> torch.Tensor:
    """Attention of a fresh sequence prefilled as rows [0, split) then [split, T)."""
    window = torch.zeros(1, RING, DIM, dtype=kv.dtype)
    outs = []
    for lo, hi in ((0, split), (split, q.shape[0])):
        if hi == lo:
            continue
        batch = _one_sequence(hi - lo, lo)
        outs.append(sparse_attention(q[lo:hi], kv[lo:hi], window, sinks, DIM**-0.5, batch, batch_invariant=invariant))
        KernelOps().store_window(kv[lo:hi], window, batch)
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_chunking_invariant_only_in_the_invariant_mode(dtype):
    gen = torch.Generator().manual_seed(3)
    tokens = 40
    q = (torch.randn(tokens, HEADS, DIM, generator=gen) * 2).to(dtype)
    kv = (torch.randn(tokens, DIM, generator=gen) * 2).to(dtype)
    sinks = torch.randn(HEADS, generator=gen)
    whole = _chunked_attention(q, kv, sinks, tokens, invariant=True)
    for split in (7, 21, 33):
        assert torch.equal(_chunked_attention(q, kv, sinks, split, invariant=True), whole)
    default_whole = _chunked_attention(q, kv, sinks, tokens, invariant=False)
    default_splits = [_chunked_attention(q, kv, sinks, s, invariant=False) for s in (7, 21, 33)]
    assert any(not torch.equal(out, default_whole) for out in default_splits)


def test_linear_row_is_the_same_in_any_row_count():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(70, 64, generator=gen).to(torch.bfloat16), torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    lone = linear(x[:1], w, None, None, batch_invariant=True)
    for rows in (2, 17, 70):
        assert torch.equal(linear(x[:rows], w, None, None, batch_invariant=True)[:1], lone)
