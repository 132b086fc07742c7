"""Shared helpers for the DeepSeek-V4.1 parity tests: fixture checkpoints, goldens, batches, a tiny runner."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from deepinfer_core.models.deepseek_v41 import DeepseekV41Cache, DeepseekV41ForCausalLM, parse_deepseek_v41_config
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.weights.loader import load_model_weights

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
CONFIGS = ("a_release_like", "b_mixed_ratios")
BLOCK_SIZE = 8
CPU = torch.device("cpu")


@lru_cache(maxsize=None)
def model(name: str, kv_cache_dtype: str) -> DeepseekV41ForCausalLM:
    ckpt = FIXTURES / name / "checkpoint"
    config = parse_deepseek_v41_config(json.loads((ckpt / "config.json").read_text()))
    m = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, CPU, kv_cache_dtype=kv_cache_dtype)
    load_model_weights(m, ckpt)
    m.bind_tokenizer_dir(ckpt)
    return m


@lru_cache(maxsize=None)
def golden(name: str, quantized: bool) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / ("golden.safetensors" if quantized else "golden_noqat.safetensors")))


def garbage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Cache storage starts as noise: nothing may be read before it is written."""
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.randn(shape).to(dtype)
    if dtype.itemsize > 1:  # integer state (the engram look-back)
        return torch.randint(-2**31, 2**31, shape, dtype=dtype)
    return torch.randint(0, 256, shape, dtype=torch.int32).to(torch.uint8).view(dtype)


class Runner:
    """Sequences in fixed slots with private block ranges; `step` runs one ForwardBatch over several of them."""

    def __init__(self, m: DeepseekV41ForCausalLM, num_slots: int = 4, max_tokens: int = 400) -> None:
        self.model = m
        self.blocks_per_seq = -(-max_tokens // BLOCK_SIZE)
        self.cache = DeepseekV41Cache(
            m.config, num_blocks=num_slots * self.blocks_per_seq, block_size=BLOCK_SIZE, num_slots=num_slots,
            dtype=torch.float32, allocate=garbage, kv_cache_dtype=m.kv_cache_dtype,
        )
        self.lens = [0] * num_slots

    def step(self, chunks: dict[int, torch.Tensor]) -> torch.Tensor:
        """chunks: slot -> new token ids. Returns log-probs [sum of chunk lengths, V] in chunk order."""
        slots = list(chunks)
        ids = torch.cat([chunks[s] for s in slots])
        positions = torch.cat([torch.arange(self.lens[s], self.lens[s] + len(chunks[s])) for s in slots])
        q_lens = [len(chunks[s]) for s in slots]
        ctx = [self.lens[s] for s in slots]
        tables = [list(range(s * self.blocks_per_seq, (s + 1) * self.blocks_per_seq)) for s in slots]
        batch = ForwardBatch(
            input_ids=ids, positions=positions,
            query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32), slot_ids=torch.tensor(slots, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32), logits_indices=torch.arange(len(ids)),
            query_lens_cpu=q_lens, context_lens_cpu=ctx, slot_ids_cpu=slots, block_tables_cpu=tables,
        )
        out = self.model(batch, self.cache)
        for s in slots:
            self.lens[s] += len(chunks[s])
        return torch.log_softmax(self.model.compute_logits(out.hidden), dim=-1)

    def greedy(self, slot: int, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `prompt` in `slot`, then `steps` single-token decodes: (tokens, chosen log-probs)."""
        logp = self.step({slot: prompt})[-1]
        tokens, chosen = [], []
        for _ in range(steps):
            tok = int(logp.argmax())
            tokens.append(tok)
            chosen.append(float(logp[tok]))
            logp = self.step({slot: torch.tensor([tok])})[-1]
        return torch.tensor(tokens), torch.tensor(chosen)


def sorted_picks(picks: torch.Tensor) -> torch.Tensor:
    """The golden layout: selected entries ascending, then the -1 (empty) slots."""
    empty = picks < 0
    ordered = torch.where(empty, torch.iinfo(torch.int32).max, picks).sort(-1).values
    return torch.where(ordered == torch.iinfo(torch.int32).max, -1, ordered).int()
