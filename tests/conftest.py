"""Shared test fixtures: a tiny random DeepSeek-V4 checkpoint, step batches, and caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from deepinfer_core.model_config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.tools import make_tiny_checkpoint

# The suite runs as `pytest -n 2` on 2 cores: one intra-op thread per worker. More threads than
# free cores make torch's tiny CPU ops spin and wait (measured 60x slower on a loaded 2-core machine).
torch.set_num_threads(1)

# One sequence's part of a step: (token ids of the step, context_len, slot id, block table).
SeqStep = tuple[torch.Tensor, int, int, Sequence[int]]


def build_forward_batch(seqs: Sequence[SeqStep]) -> ForwardBatch:
    """A ForwardBatch over the given sequences (rows in order), block tables padded with -1."""
    query_lens = [len(ids) for ids, _, _, _ in seqs]
    context_lens = [ctx for _, ctx, _, _ in seqs]
    width = max(len(table) for _, _, _, table in seqs)
    tables = [list(table) + [-1] * (width - len(table)) for _, _, _, table in seqs]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.cat([ids for ids, _, _, _ in seqs]).long(),
        positions=torch.cat([torch.arange(ctx, ctx + len(ids)) for ids, ctx, _, _ in seqs]),
        query_start_loc=starts,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_ids=torch.tensor([slot for _, _, slot, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.arange(int(starts[-1])),
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        slot_ids_cpu=[slot for _, _, slot, _ in seqs],
        block_tables_cpu=tables,
    )


def build_cache(
    config: DeepseekV4Config, *, num_slots: int = 4, num_blocks: int = 64, block_size: int = 0,
    dtype: torch.dtype = torch.float32,
) -> DeepseekV4Cache:
    """A cache whose storage starts as random garbage, as a reused memory pool would."""
    block_size = block_size or 2 * DeepseekV4Cache.block_size_multiple(config)
    gen = torch.Generator().manual_seed(1234)
    return DeepseekV4Cache(
        config, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, dtype=dtype,
        allocate=lambda shape, dt: torch.randn(shape, generator=gen).to(dt),
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (float32, transformers' save_pretrained names + official mtp.0.*)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-v4")


@pytest.fixture(scope="session")
def make_batch() -> Callable[[Sequence[SeqStep]], ForwardBatch]:
    return build_forward_batch


@pytest.fixture(scope="session")
def make_cache() -> Callable[..., DeepseekV4Cache]:
    return build_cache
