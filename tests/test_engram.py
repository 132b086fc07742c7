"""Engram memory (MODEL_SPEC_V41 §6): table sizes from the config, hash ids, DEAD look-back, token map."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from deepinfer_core.model_config import ModelConfigError
from deepinfer_core.models.deepseek_v41 import parse_deepseek_v41_config
from deepinfer_core.models.deepseek_v41.engram import DEAD, EngramHasher, build_compressed_token_map
from deepinfer_core.platform.kernel_ops import KernelOps
from v41_fixtures import CONFIGS, FIXTURES, model

RELEASE_TEXT = {"vocab_size": 129280, "num_hidden_layers": 40, "engram_layer_ids": [1, 14],
                "engram_vocab_size": 16000000, "engram_max_ngram_size": 4, "engram_n_heads": 8}


def test_released_table_sizes_follow_from_the_config() -> None:
    config = parse_deepseek_v41_config({"text_config": RELEASE_TEXT}).text_config
    assert config.engram_num_embeddings == (384006168, 384016682)


def test_wrong_table_size_is_rejected_naming_the_field() -> None:
    with pytest.raises(ModelConfigError, match="engram_num_embeddings"):
        parse_deepseek_v41_config({"text_config": {**RELEASE_TEXT, "engram_num_embeddings": [384006168, 1]}})


@pytest.mark.parametrize("name", CONFIGS)
def test_fixture_tables_have_the_derived_sizes(name: str) -> None:
    m = model(name, "bf16")
    raw = json.loads((FIXTURES / name / "checkpoint" / "config.json").read_text())["text_config"]
    assert list(m.config.text_config.engram_num_embeddings) == raw["engram_num_embeddings"]
    for layer in m.config.text_config.engram_layer_ids:
        table = m.layers[layer].engram.embed.weight
        assert table.device.type == "cpu"  # host memory whatever the model's device


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _straightforward_hash(config, token_map: list[int], ids: list[int]) -> list[list[list[int]]]:
    """hash[t][layer][col] written directly from the spec, one position at a time."""
    n, heads, vc = config.engram_max_ngram_size, config.engram_n_heads, config.engram_compressed_vocab_size
    seen, primes = set(), []
    for _ in config.engram_layer_ids:
        layer = []
        for _ in range(n - 1):
            p, row = config.engram_vocab_size - 1, []
            for _ in range(heads):
                p += 1
                while p in seen or not _is_prime(p):
                    p += 1
                seen.add(p)
                row.append(p)
            layer.append(row)
        primes.append(layer)
    bound = np.iinfo(np.int64).max // vc // 2
    mult = [[int(u) * 2 + 1 for u in np.random.default_rng(10007 * L).integers(0, bound, size=n, dtype=np.int64)]
            for L in config.engram_layer_ids]
    pad = token_map[config.engram_pad_id]
    out = []
    for t in range(len(ids)):
        toks, dead = [], False
        for s in range(n):
            dead = dead or t - s < 0 or ids[t - s] == DEAD
            toks.append(pad if dead else token_map[ids[t - s]])
        per_layer = []
        for li, layer_primes in enumerate(primes):
            flat, offset, rolling = [], 0, toks[0] * mult[li][0]
            for g in range(1, n):
                rolling ^= toks[g] * mult[li][g]
                for p in layer_primes[g - 1]:
                    flat.append(rolling % p + offset)
                    offset += p
            per_layer.append(flat)
        out.append(per_layer)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_hash_ids_match_the_spec_across_steps(name: str) -> None:
    config = model(name, "bf16").config.text_config
    token_map = list(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(3)).tolist())
    token_map = [t % config.engram_compressed_vocab_size for t in token_map]
    hasher = EngramHasher(config, KernelOps(), token_map)
    ids = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(4))
    history = torch.full((2, config.engram_max_ngram_size - 1), 12345, dtype=torch.int64)  # stale slot content
    got = []
    for lo, hi in ((0, 1), (1, 3), (3, 23)):  # context 0 ignores the slot; later steps read the look-back
        batch = _batch(ids[lo:hi], context=lo, slot=1)
        got.append(hasher.step(batch, history))
    expected = torch.tensor(_straightforward_hash(config, token_map, ids.tolist()))
    assert torch.equal(torch.cat(got), expected)


def test_batched_step_equals_one_sequence_at_a_time() -> None:
    """The engine's steps mix sequences: fresh (context 0, stale slot content), mid-prompt chunks and
    one-token decodes, in any slot order; hashing them together must equal hashing each alone."""
    from deepinfer_core.models.forward_batch import ForwardBatch

    config = model("a_release_like", "bf16").config.text_config
    token_map = [t % config.engram_compressed_vocab_size for t in range(config.vocab_size)]
    hasher = EngramHasher(config, KernelOps(), token_map)
    gen = torch.Generator().manual_seed(5)
    lookback = config.engram_max_ngram_size - 1
    history = torch.randint(0, config.engram_compressed_vocab_size, (5, lookback), generator=gen)
    slots, contexts, lens = [3, 0, 4, 1], [0, 9, 2, 40], [6, 1, 2, 5]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=gen)
    alone_history, alone, start = history.clone(), [], 0
    for slot, context, n in zip(slots, contexts, lens):
        alone.append(hasher.step(_batch(ids[start:start + n], context, slot), alone_history))
        start += n
    batch = ForwardBatch(
        input_ids=ids, positions=torch.zeros(len(ids), dtype=torch.long),
        query_start_loc=torch.tensor([0, *np.cumsum(lens)]), context_lens=torch.tensor(contexts),
        slot_ids=torch.tensor(slots), block_tables=torch.zeros(4, 1), logits_indices=torch.arange(len(ids)),
        query_lens_cpu=lens, context_lens_cpu=contexts, slot_ids_cpu=slots, block_tables_cpu=[[0]] * 4,
    )
    assert torch.equal(hasher.step(batch, history), torch.cat(alone))
    assert torch.equal(history, alone_history)


def test_dead_history_pads_every_longer_ngram() -> None:
    config = model("a_release_like", "bf16").config.text_config
    hasher = EngramHasher(config, KernelOps(), list(range(config.vocab_size)))
    history = torch.tensor([DEAD, 9, DEAD])  # N = 4: ids at t-3, t-2, t-1
    tokens = hasher.ngram_tokens(history, torch.tensor([5, 6]))
    pad = config.engram_pad_id
    assert tokens.tolist() == [[5, pad, pad, pad], [6, 5, pad, pad]]


def test_compressed_token_map_merges_normalised_spellings() -> None:
    vocab = ["<s>", "The", "the", " THE", "café", "cafe", " ", "\t", "x", "  y "]
    tok = Tokenizer(models.WordLevel({v: i for i, v in enumerate(vocab)}, unk_token="<s>"))
    token_map, size = build_compressed_token_map(tok)
    assert token_map[1] == token_map[2] == token_map[3]  # case and surrounding space fold
    assert token_map[4] == token_map[5]  # accents strip
    assert token_map[6] == token_map[7] != token_map[0]  # a lone whitespace run stays " "
    assert token_map[9] != token_map[8]
    assert size == len(set(token_map)) == 6
    first_seen = list(dict.fromkeys(token_map))
    assert first_seen == list(range(size))  # dense ids in first-seen order


def _batch(ids: torch.Tensor, context: int, slot: int):
    from deepinfer_core.models.forward_batch import ForwardBatch

    n = len(ids)
    return ForwardBatch(
        input_ids=ids, positions=torch.arange(context, context + n), query_start_loc=torch.tensor([0, n]),
        context_lens=torch.tensor([context]), slot_ids=torch.tensor([slot]), block_tables=torch.zeros(1, 1),
        logits_indices=torch.arange(n), query_lens_cpu=[n], context_lens_cpu=[context], slot_ids_cpu=[slot],
        block_tables_cpu=[[0]],
    )


@pytest.mark.parametrize("head_dim", [16, 64])  # a ragged scale block; whole blocks (the KV's fp8 decode)
def test_quantized_table_rows_are_gathered_on_the_host_and_dequantized(head_dim: int) -> None:
    from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_core.quantization import dequantize_fp8_block, quantize_fp8_block

    raw = json.loads((FIXTURES / "a_release_like" / "checkpoint" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    raw["text_config"]["engram_head_dim"] = head_dim
    m = DeepseekV41ForCausalLM(parse_deepseek_v41_config(raw), KernelOps(), torch.float32, torch.device("cpu"))
    engram = m.layers[1].engram
    table = torch.randn(engram.embed.weight.shape, generator=torch.Generator().manual_seed(6))
    weight, scale = quantize_fp8_block(table, (1, 32))
    engram.embed.weight.data.copy_(weight)
    engram.embed.scale.data.copy_(scale)
    ids = torch.tensor([[0, 5, 433, 7, 9, 2], [1, 1, 2, 3, 5, 8]])
    rows = engram.gather(ids)
    expected = dequantize_fp8_block(weight, scale, (1, 32), torch.float32)[ids.reshape(-1)].view(2, -1)
    assert rows.shape == (2, 6 * head_dim) and torch.equal(rows, expected)
