"""Rolling back a verification step's rejected tail leaves only accepted state where later steps read.

A verification step runs [last token, drafts] per sequence at context ctx and keeps the first `kept`
positions. Checked on every layer (sliding windows, CSA/HCA raw-projection rings incl. CSA's overlap,
compressed entries, indexer keys), across window boundaries of the tiny checkpoint (sliding window
8, CSA ratio 4, HCA ratio 8):
- bitwise: everything a later step reads holds the pre-step values for positions < ctx and the
  step's own values for the kept positions; scrambling everything else changes no later logits;
- against a cache that only ever saw the kept tokens: equal up to float32 rounding. Not bitwise,
  because the reference kernels are not batch-invariant (a GEMM row's bits depend on the row count,
  and the two caches ran steps of different lengths).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import build_cache, build_forward_batch

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v4.rollback import (
    RingSnapshot,
    StepTooLongForRing,
    ring_tensors,
)
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.weights.loader import load_model_weights

CONTEXTS = (21, 30)  # steps from 21 and 30 close CSA and HCA windows at positions 23 and 31
BLOCKS = 4           # blocks of 16 positions per sequence
CASES = [(1, (1, 2)), (3, (1, 3)), (3, (2, 4)), (5, (4, 1)), (7, (8, 6))]  # (drafts, kept per sequence)
# float32 on both sides; only GEMM blocking (row count) differs.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    config = load_model_config(tiny_checkpoint)
    model = DeepseekV4ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"))
    load_model_weights(model, tiny_checkpoint)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, config.vocab_size, (ctx + 16,), generator=gen) for ctx in CONTEXTS]
    return config, model, tokens


def step(model, cache, parts) -> torch.Tensor:
    """Logits of one step over (tokens, context_len) per sequence, sequence i in slot i."""
    batch = build_forward_batch([
        (ids, ctx, i, list(range(i * BLOCKS, (i + 1) * BLOCKS))) for i, (ids, ctx) in enumerate(parts)
    ])
    return model.compute_logits(model(batch, cache).hidden)


def prefilled(config, model, tokens):
    cache = build_cache(config, num_slots=2)
    step(model, cache, [(t[:ctx], 0) for t, ctx in zip(tokens, CONTEXTS)])
    return cache


def drafts_for(config, tokens, num_drafts):
    """The true next token, then drafts that differ from the tokens decoded later."""
    drafts = [t[ctx:ctx + 1 + num_drafts].clone() for t, ctx in zip(tokens, CONTEXTS)]
    for d in drafts:
        d[1:] = (d[1:] + 7) % config.vocab_size
    return drafts


def verify_and_roll_back(config, model, cache, drafts, kept, *, restore: bool = True):
    """Returns the cache as it was right after the step (before the rollback)."""
    lengths = [len(d) for d in drafts]
    snapshot = RingSnapshot.take(ring_tensors(cache.layers[: config.num_hidden_layers]), [0, 1], CONTEXTS, lengths)
    step(model, cache, list(zip(drafts, CONTEXTS)))
    after = copy.deepcopy(cache)
    if restore:
        snapshot.restore(torch.tensor(kept))
    return after


@dataclass(frozen=True)
class Readable:
    """Rows `index` of `tensor` (a slot's ring rows or a sequence's entries) hold positions `positions`
    (for an entry: the position that closes it); `area` is all of that slot's or sequence's storage."""

    tensor: torch.Tensor
    area: tuple
    index: tuple
    positions: torch.Tensor
    seq: int


def readable(config, cache, contexts) -> list[Readable]:
    """Everything a step at contexts[i] may read: window rows of the last W-1 positions, raw-projection
    rows of the last span-1 positions, and the entries closed before contexts[i]."""
    out = []
    for spec, layer in zip(config.all_layers, cache.layers):
        for seq, ctx in enumerate(contexts):
            rings = [layer.window] + [
                t for state in (layer.compressor, layer.indexer) if state is not None
                for t in (state.state_kv, state.state_gate)
            ]
            for ring in rings:
                span = ring.shape[1]
                pos = torch.arange(max(0, ctx - span + 1), ctx)
                out.append(Readable(ring, (seq,), (seq, pos % span), pos, seq))
            for state in (layer.compressor, layer.indexer):
                if state is None:
                    continue
                ratio, per_block = spec.compress_ratio, state.entries.shape[1]
                closed = torch.arange(ctx // ratio)
                blocks = slice(seq * BLOCKS, (seq + 1) * BLOCKS)
                index = (seq * BLOCKS + closed // per_block, closed % per_block)
                out.append(Readable(state.entries, (blocks,), index, closed * ratio + ratio - 1, seq))
    return out


@pytest.mark.parametrize("num_drafts,kept", CASES)
def test_rollback_leaves_exactly_the_accepted_state(setup, num_drafts, kept) -> None:
    config, model, tokens = setup
    cache = prefilled(config, model, tokens)
    before = copy.deepcopy(cache)
    after = verify_and_roll_back(config, model, cache, drafts_for(config, tokens, num_drafts), kept)
    contexts = [ctx + n for ctx, n in zip(CONTEXTS, kept)]
    parts = zip(readable(config, cache, contexts), readable(config, before, contexts), readable(config, after, contexts))
    for got, old, new in parts:
        from_step = (got.positions >= CONTEXTS[got.seq]).view(-1, *([1] * (got.tensor.dim() - 2)))
        want = torch.where(from_step, new.tensor[new.index], old.tensor[old.index])
        assert torch.equal(got.tensor[got.index], want)

    # Nothing else is ever read: fill it with random values and decode on, bitwise equal.
    scrambled = copy.deepcopy(cache)
    gen = torch.Generator().manual_seed(9)
    for part in readable(config, scrambled, contexts):
        keep = part.tensor[part.index].clone()
        part.tensor[part.area] = torch.randn(part.tensor[part.area].shape, generator=gen)
        part.tensor[part.index] = keep
    for _ in range(6):
        parts = [(t[c:c + 1], c) for t, c in zip(tokens, contexts)]
        assert torch.equal(step(model, cache, parts), step(model, scrambled, parts))
        contexts = [c + 1 for c in contexts]


@pytest.mark.parametrize("num_drafts,kept", CASES[:3])
def test_rolled_back_cache_matches_a_cache_that_never_saw_the_drafts(setup, num_drafts, kept) -> None:
    config, model, tokens = setup
    drafts = drafts_for(config, tokens, num_drafts)
    rolled, clean = prefilled(config, model, tokens), prefilled(config, model, tokens)
    verify_and_roll_back(config, model, rolled, drafts, kept)
    step(model, clean, [(d[:n], ctx) for d, n, ctx in zip(drafts, kept, CONTEXTS)])
    contexts = [ctx + n for ctx, n in zip(CONTEXTS, kept)]
    for got, want in zip(readable(config, rolled, contexts), readable(config, clean, contexts)):
        torch.testing.assert_close(got.tensor[got.index], want.tensor[want.index], **TOLERANCE)
    for _ in range(6):
        parts = [(t[c:c + 1], c) for t, c in zip(tokens, contexts)]
        torch.testing.assert_close(step(model, rolled, parts), step(model, clean, parts), **TOLERANCE)
        contexts = [c + 1 for c in contexts]


def test_without_the_rollback_rejected_drafts_change_later_logits(setup) -> None:
    """The two tests above can fail: skipping the restore leaves rejected rows where steps read."""
    config, model, tokens = setup
    drafts, kept = drafts_for(config, tokens, 3), (1, 2)
    rolled, clean = prefilled(config, model, tokens), prefilled(config, model, tokens)
    verify_and_roll_back(config, model, rolled, drafts, kept, restore=False)
    step(model, clean, [(d[:n], ctx) for d, n, ctx in zip(drafts, kept, CONTEXTS)])
    parts = [(t[ctx + n:ctx + n + 1], ctx + n) for t, n, ctx in zip(tokens, kept, CONTEXTS)]
    gap = (step(model, rolled, parts) - step(model, clean, parts)).abs().max()
    assert gap > 1e-2


def test_snapshot_refuses_a_step_longer_than_a_ring(setup) -> None:
    config, _, _ = setup
    cache = build_cache(config, num_slots=1)
    with pytest.raises(StepTooLongForRing, match="num_draft_tokens"):
        RingSnapshot.take(ring_tensors(cache.layers), [0], [5], [config.sliding_window + 1])
