"""Hopper's Gluon prefill attention (`sparse_attention_wgmma`) against the reference op, on a GPU: Gluon has no
interpreter, so on the CPU it is only compiled (tests/test_kernels_compile.py) and its dispatch rule tested."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_checks import assert_matches

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.conformance import _to_device as to_device
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_kernels import sparse_attention as attention_module
from deepinfer_kernels.sparse_attention_wgmma import wgmma_attention_supported

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DIM, RING, BLOCK_SIZE, RATIO = 512, 128, 64, 4
TOLERANCE = 2e-2  # bf16: as tests/test_kernels_sparse_attention.py (probabilities rounded in other places)


def test_only_hopper_bf16_steps_of_the_kv_head_it_was_written_for_are_taken():
    bf16 = torch.empty(2, 64, DIM, dtype=torch.bfloat16)
    kv = torch.empty(2, DIM, dtype=torch.bfloat16)
    assert not wgmma_attention_supported(bf16, kv, kv, None, 32)  # a CPU tensor
    if HOPPER:
        cuda = bf16.cuda()
        assert wgmma_attention_supported(cuda, kv.cuda(), kv.cuda(), None, 32)
        assert not wgmma_attention_supported(cuda, kv.cuda(), kv.cuda(), kv.cuda().to(torch.float8_e4m3fn), 32)
        assert not wgmma_attention_supported(cuda[..., :256], kv.cuda(), kv.cuda(), None, 32)


def _batch(make_batch, query_lens: list[int], context_lens: list[int], gen: torch.Generator, device) -> ForwardBatch:
    """Sequences after context_lens cached tokens, shuffled block tables with room for every position."""
    per_seq = max(c + q for q, c in zip(query_lens, context_lens)) // BLOCK_SIZE + 1
    blocks = torch.randperm(per_seq * len(query_lens), generator=gen).tolist()
    steps = [(torch.zeros(q, dtype=torch.long), c, len(query_lens) - 1 - i, blocks[i * per_seq:(i + 1) * per_seq])
             for i, (q, c) in enumerate(zip(query_lens, context_lens))]
    return to_device(make_batch(steps), device)


def _selected(batch: ForwardBatch, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Per row, top_k distinct entries of its sequence (some not yet visible to the row), padded with -1."""
    rows = []
    for n, ctx in zip(batch.query_lens_cpu, batch.context_lens_cpu):
        entries = (ctx + n) // RATIO
        for _ in range(n):
            picks = torch.full((top_k,), -1, dtype=torch.int32)
            drawn = torch.randperm(entries, generator=gen)[:top_k]
            picks[: drawn.numel()] = drawn.to(torch.int32)
            rows.append(picks)
    return torch.stack(rows)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("layer", ["sliding", "all_entries", "selected"])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("replay", [False, True])
def test_wgmma_prefill_attention_matches_reference(monkeypatch, make_batch, layer, rotary, replay):
    """A fresh prompt longer than the ring, a continued chunk whose window is in the ring, a short one;
    70 heads (a partial second head block); the bounded replay's window starts."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(len(layer) + 2 * rotary + 4 * replay)
    batch = _batch(make_batch, [600, 300, 37], [0, 517, 90], gen, device)
    if replay:
        batch = replace(batch, window_starts_cpu=[0, 480, 60])
    heads, tokens = 70, batch.num_tokens
    q = torch.randn(tokens, heads, DIM, generator=gen).to(torch.bfloat16).to(device)
    kv = torch.randn(tokens, DIM, generator=gen).to(torch.bfloat16).to(device)
    window = torch.randn(3, RING, DIM, generator=gen).to(torch.bfloat16).to(device)
    sinks = torch.randn(heads, generator=gen).to(device)
    kwargs = {}
    if layer != "sliding":
        blocks = batch.block_tables.numel()
        kwargs = {"entries": torch.randn(blocks, BLOCK_SIZE // RATIO, DIM, generator=gen).to(torch.bfloat16).to(device),
                  "ratio": RATIO}
    if layer == "selected":
        kwargs["selected"] = _selected(batch, 96, gen).to(device)
    launched = []
    wgmma = attention_module.wgmma_attention
    monkeypatch.setattr(attention_module, "wgmma_attention", lambda *a: launched.append(1) or wgmma(*a))
    args = (q, kv, window, sinks, DIM**-0.5, batch)
    if rotary:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=device) / 64))
        out = attention_module.sparse_attention(*args, **kwargs, inv_freq=inv_freq, q_norm_eps=1e-6)
        expected = KernelOps().rotary_attention(*args, inv_freq, 1e-6, **kwargs)
    else:
        out = attention_module.sparse_attention(*args, **kwargs)
        expected = KernelOps().sparse_attention(*args, **kwargs)
    assert launched == [1]
    assert_matches(out, expected, TOLERANCE)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("layer", ["sliding", "selected"])
@pytest.mark.parametrize("group", [128, 64])
def test_wgmma_output_quantised_in_its_epilogue_is_the_bf16_output_quantised(make_batch, layer, group):
    """`quantize_group`: the epilogue's fp8 codes and scales (the rotated channels de-rotated in shared memory
    first) are the bits `quantize_fp8_rows` makes of the same launch's bf16 output; 70 heads (a partial block)."""
    from deepinfer_kernels.activation_quant import quantize_fp8_rows

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(group + len(layer))
    batch = _batch(make_batch, [600, 300, 37], [0, 517, 90], gen, device)
    heads, tokens = 70, batch.num_tokens
    q = (3 * torch.randn(tokens, heads, DIM, generator=gen)).to(torch.bfloat16).to(device)
    kv = torch.randn(tokens, DIM, generator=gen).to(torch.bfloat16).to(device)
    window = torch.randn(3, RING, DIM, generator=gen).to(torch.bfloat16).to(device)
    sinks = torch.randn(heads, generator=gen).to(device)
    kwargs = {}
    if layer == "selected":
        kwargs = {"entries": torch.randn(batch.block_tables.numel(), BLOCK_SIZE // RATIO, DIM, generator=gen)
                  .to(torch.bfloat16).to(device), "ratio": RATIO, "selected": _selected(batch, 96, gen).to(device)}
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=device) / 64))
    args = (kv, window, sinks, DIM**-0.5, batch)
    out = attention_module.sparse_attention(q.clone(), *args, **kwargs, inv_freq=inv_freq, q_norm_eps=1e-6)
    codes, scales = attention_module.sparse_attention(q.clone(), *args, **kwargs, inv_freq=inv_freq, q_norm_eps=1e-6,
                                                      quantize_group=group)
    expected_codes, expected_scales = quantize_fp8_rows(out.view(tokens, -1), group)
    assert torch.equal(codes.view(torch.uint8).view(tokens, -1), expected_codes.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
