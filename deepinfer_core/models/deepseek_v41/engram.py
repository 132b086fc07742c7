"""Engram conditional memory (MODEL_SPEC_V41 §6): n-gram hash ids from the tokens, table rows, gated injection.

The hash ids of a token depend only on the token ids (through the tokenizer-derived compressed
vocabulary). They are computed on the model's device, from the step's device token ids, so a decode
step that feeds back the token still being sampled never waits for the host. The tables (~100 GB each
in the release) stay in host memory; `KernelOps.gather_rows` reads the step's rows from there (zero-copy
on the nvidia backend) and only those rows reach the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.linear import empty_param
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps, padded_ngrams
from deepinfer_core.quantization import dequantize_fp8_block

from .config import DeepseekV41TextConfig
from .engram_layout import engram_multipliers, engram_offsets, engram_primes
from .factory import ModuleFactory

__all__ = ["DEAD", "build_compressed_token_map", "load_compressed_token_map", "EngramHasher", "Engram"]

DEAD = -1
HOST = torch.device("cpu")
ROW_SCALE_BLOCK = 32  # release tables: one e8m0 scale per 32 columns of a row


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """(compressed id of every token id, compressed vocabulary size) for a `tokenizers.Tokenizer`.

    Tokens whose decoded text normalises alike share an id (first-seen order). The key is the raw
    token string when the decoded text holds U+FFFD (a partial UTF-8 byte), else the text after
    NFKC, NFD, accent stripping, lower-casing, whitespace runs -> " " and stripping, where a token that
    is exactly one whitespace run stays " "; an empty result falls back to the decoded text.
    """
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"  # private-use sentinel: a lone " " must survive Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(),
        normalizers.Replace(keep_space, " "),
    ])
    ids: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(ids.setdefault(key, len(ids)))
    return token_map, len(ids)


def load_compressed_token_map(checkpoint_dir: str | Path, config: DeepseekV41TextConfig) -> list[int]:
    """The compressed token map from `tokenizer.json` in `checkpoint_dir`, checked against the config."""
    from tokenizers import Tokenizer

    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"the engram layers need the tokenizer: no tokenizer.json in {checkpoint_dir}")
    token_map, size = build_compressed_token_map(Tokenizer.from_file(str(path)))
    if size != config.engram_compressed_vocab_size:
        raise ValueError(
            f"the tokenizer in {checkpoint_dir} gives a compressed vocabulary of {size} ids but "
            f"`engram_compressed_vocab_size` is {config.engram_compressed_vocab_size}; every engram hash would "
            "address the wrong rows. Use the checkpoint's own tokenizer."
        )
    return token_map


class EngramHasher:
    """Hash ids [T, n_engram_layers, (N-1)*heads] of a step, and the per-slot look-back they need.

    History per slot: the compressed ids of the N-1 positions before the step (DEAD before the start).
    For position t and shift s, the n-gram token is the id at t-s, or the pad id once any shift <= s
    is DEAD. Hash of the n-gram ending at shift n: XOR over s <= n of id_s * multiplier_s (int64), mod
    each head's prime, plus the head's table offset. Padding and hashing are one op, `KernelOps.ngram_hash`.

    `step` runs where the history lives (the model's device): it reads the step's token ids there, so a
    step that feeds back the token still being sampled hashes it without the host waiting for it. Only
    index tensors built from the host's query lengths cross to the device (one copy a step; none in a plain
    decode step, hashed from the device tensors alone).
    """

    def __init__(self, config: DeepseekV41TextConfig, ops: KernelOps, token_map: list[int]) -> None:
        c = config
        if len(token_map) < c.vocab_size:
            raise ValueError(f"compressed token map covers {len(token_map)} ids, fewer than vocab_size {c.vocab_size}")
        self.ops, self.ngram = ops, c.engram_max_ngram_size
        self.token_map = torch.tensor(token_map, dtype=torch.int64)  # host: look-backs rebuilt from host tokens
        self.pad_id = token_map[c.engram_pad_id]
        primes = engram_primes(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
        multipliers = engram_multipliers(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_compressed_vocab_size)
        self._constants = {HOST: _HashConstants(
            self.token_map,
            torch.from_numpy(multipliers),                               # [L, N]
            torch.tensor(primes, dtype=torch.int64),                     # [L, N-1, heads]
            torch.tensor(engram_offsets(primes), dtype=torch.int64),     # [L, (N-1)*heads]
        )}

    def _on(self, device: torch.device) -> _HashConstants:
        if device not in self._constants:
            self._constants[device] = _HashConstants(*(t.to(device) for t in self._constants[HOST]))
        return self._constants[device]

    def lookback(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[N-1] host look-back after a sequence's `token_ids` (their last N-1 compressed ids, DEAD in front)."""
        width = self.ngram - 1
        tail = torch.tensor(list(token_ids)[max(0, len(token_ids) - width):], dtype=torch.int64)
        row = torch.full((width,), DEAD, dtype=torch.int64)
        row[width - tail.numel():] = self.token_map[tail]
        return row

    def ngram_tokens(self, history: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
        """[q, N] n-gram tokens (shift-major, padded) of q new compressed ids after `history` [N-1]."""
        return padded_ngrams(self._ngrams(history[None], new_ids, [new_ids.shape[0]])[0], self.pad_id)

    def _ngrams(
        self, before: torch.Tensor, new_ids: torch.Tensor, query_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For sequences with look-backs `before` [S, N-1] and new ids `new_ids` [T] (query_lens[s] each,
        concatenated): their n-gram tokens [T, N] (DEAD where before a start, not padded) and each
        sequence's look-back after them [S, N-1].
        One pass over the whole batch: a per-sequence loop costs ~0.25 ms a sequence on the host.
        The positions are planned on the host (they depend only on `query_lens`) and sent in one copy."""
        lookback, num_tokens = self.ngram - 1, new_ids.shape[0]
        q = torch.tensor(query_lens, dtype=torch.int64)
        joined_len = q + lookback
        joined_start = torch.cumsum(joined_len, 0) - joined_len  # each sequence: its look-back, then its new ids
        owner = torch.repeat_interleave(torch.arange(len(query_lens)), q)
        new_pos = torch.arange(num_tokens) + (joined_start + lookback - (torch.cumsum(q, 0) - q))[owner]
        plan = torch.cat([
            (joined_start[:, None] + torch.arange(lookback)).flatten(),    # where the look-backs go
            new_pos,                                                       # where the new ids go
            (new_pos[:, None] - torch.arange(self.ngram)).flatten(),       # each token's n-gram
            ((joined_start + q)[:, None] + torch.arange(lookback)).flatten(),  # each sequence's new look-back
        ])
        plan = _to_device(plan, new_ids.device)
        old_at, new_at, ngram_at, tail_at = plan.split(
            [before.numel(), num_tokens, num_tokens * self.ngram, before.numel()])
        joined = torch.empty(int(joined_len.sum()), dtype=torch.int64, device=new_ids.device)
        joined[old_at] = before.flatten()
        joined[new_at] = new_ids
        return joined[ngram_at].view(num_tokens, self.ngram), joined[tail_at].view(before.shape)

    def hash(self, tokens: torch.Tensor) -> torch.Tensor:
        """[q, N] n-gram tokens (DEAD where before a start: the op pads them) -> [q, L, (N-1)*heads] table row ids."""
        k = self._on(tokens.device)
        return self.ops.ngram_hash(tokens, self.pad_id, k.multipliers, k.primes, k.offsets)

    def step(
        self,
        batch: ForwardBatch,
        history: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        dead_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Hash ids of every token of `batch`, on `history`'s device; updates `history` [num_slots, N-1]
        per slot. `input_ids`: the batch's token ids (default `batch.input_ids`); `dead_rows`: rows that
        are image-span tokens, DEAD in the history like positions before the start."""
        device = history.device
        ids = batch.input_ids if input_ids is None else input_ids
        compressed = self._on(device).token_map[ids.to(device)]
        if batch.is_plain_decode and not dead_rows:  # from the device tensors only: nothing planned on the host
            slots = batch.slot_ids.to(torch.long)
            before = history[slots].masked_fill((batch.context_lens == 0)[:, None], DEAD)
            tokens, tails = self._decode_ngrams(before, compressed)
        else:
            slots_fresh = _to_device(
                torch.tensor([batch.slot_ids_cpu, [c == 0 for c in batch.context_lens_cpu]], dtype=torch.int64),
                device)
            if dead_rows:
                compressed[_to_device(torch.tensor(dead_rows, dtype=torch.int64), device)] = DEAD
            slots, fresh = slots_fresh[0], slots_fresh[1].bool()
            before = history[slots].masked_fill(fresh[:, None], DEAD)
            tokens, tails = self._ngrams(before, compressed, batch.query_lens_cpu)
        history[slots] = tails
        return self.hash(tokens)

    def _decode_ngrams(self, before: torch.Tensor, new_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_ngrams` of one new id a sequence: the look-back then the id, read newest first."""
        joined = torch.cat([before, new_ids[:, None]], dim=1)  # [S, N], oldest first
        return joined.flip(1), joined[:, 1:]


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without the host waiting for the stream: staged in pinned memory."""
    return values if device.type == "cpu" else values.pin_memory().to(device, non_blocking=True)


class _HashConstants(NamedTuple):
    token_map: torch.Tensor    # [vocab] compressed id of every token id
    multipliers: torch.Tensor  # [L, N]
    primes: torch.Tensor       # [L, N-1, heads]
    offsets: torch.Tensor      # [L, (N-1)*heads]


class Engram(nn.Module):
    """One engram layer: the host table `embed.weight` [rows, head_dim] (fp8 e4m3 with `embed.scale`
    e8m0 [rows, ceil(head_dim / 32)] for a quantised checkpoint), `wkv`, `q_weight`, `k_weight` [hc_mult, D]."""

    def __init__(self, f: ModuleFactory, layer: int) -> None:
        super().__init__()
        c = f.config
        self.ops, self.eps, self.hc_mult, self.hidden = f.ops, c.rms_norm_eps, c.hc_mult, c.hidden_size
        self.dtype = f.dtype
        rows, width = c.engram_num_embeddings[c.engram_layer_ids.index(layer)], c.engram_head_dim
        quantized = f.full_config.quantization_config is not None
        self.embed = nn.Module()
        self.embed.weight = empty_param((rows, width), torch.float8_e4m3fn if quantized else f.dtype, HOST)
        self.embed.scale = empty_param((rows, -(-width // ROW_SCALE_BLOCK)), torch.float8_e8m0fnu, HOST) if quantized else None
        n_cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        self.wkv = f.linear(n_cols * c.engram_head_dim, (c.hc_mult + 1) * c.hidden_size, quantizable=True)
        self.q_weight = f.param(c.hc_mult, c.hidden_size)
        self.k_weight = f.param(c.hc_mult, c.hidden_size)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ids [T, cols] (on the compute device) from the host table; only those rows (still fp8
        when the table is) reach the device, where they are dequantised. Returns [T, cols*head_dim]."""
        flat = ids.reshape(-1)
        rows = self.ops.gather_rows(self.embed.weight, flat)
        if self.embed.scale is not None:
            scales = self.ops.gather_rows(self.embed.scale, flat)
            if rows.shape[-1] % ROW_SCALE_BLOCK == 0:  # e8m0 bytes are ue8m0 exponents: the KV's fp8 decode
                rows = self.ops.fp8_block_dequantize(rows, scales.view(torch.uint8), self.dtype)
            else:  # a ragged last block
                rows = dequantize_fp8_block(rows, scales, (1, ROW_SCALE_BLOCK), self.dtype)
        return rows.to(self.dtype).view(ids.shape[0], -1)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, dead_rows: torch.Tensor | None = None) -> torch.Tensor:
        """streams [T, hc_mult, D], rows [T, cols*head_dim] from `gather` -> updated streams. `dead_rows`
        (int64, image-span tokens) keep their streams: the gate is 0 at a DEAD token."""
        kv = self.wkv(rows.to(streams.dtype))
        key = kv[:, : self.hc_mult * self.hidden].view(-1, self.hc_mult, self.hidden)
        value = kv[:, self.hc_mult * self.hidden:]
        out = self.ops.engram_gate(streams, key, value, self.q_weight, self.k_weight, self.eps)
        return out if dead_rows is None else out.index_copy(0, dead_rows, streams[dead_rows])
