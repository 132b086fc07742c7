"""DeepseekV41ForCausalLM, text path: embedding, engram, single-pass mHC blocks, final collapse, norm, head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.model import ModelOutput
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

from .attention import ForwardState
from .block import Block
from .cache import DeepseekV41Cache
from .config import DeepseekV41Config
from .engram import EngramHasher, load_compressed_token_map
from .factory import ModuleFactory
from .kv_quant import KvCacheDtype, KvQuantizer, kv_formats
from .trace import Trace

__all__ = ["DeepseekV41ForCausalLM", "ModelOutput"]


class Embedding(nn.Module):
    def __init__(self, f: ModuleFactory) -> None:
        super().__init__()
        self.weight = f.param(f.config.vocab_size, f.config.hidden_size)


class DeepseekV41ForCausalLM(nn.Module):
    """DeepSeek-V4.1's text model over a flat token batch, written against `KernelOps` only.

    Parameters carry the official checkpoint names (`embed.weight`, `layers.{i}.attn.compressor.wkv.weight`,
    `layers.{i}.engram.embed.weight`, ...), allocated empty; engram tables live in host memory.
    - `forward(batch, cache) -> ModelOutput(hidden [T, D], streams [T, hc_mult, D])` runs every token of
      the step and updates `cache` (a `DeepseekV41Cache`); `gather_engram_rows(batch, cache)` is its
      token-only engram part, which an engine may run ahead and pass as `forward(..., engram_rows=)`.
    - `compute_logits(hidden [N, D]) -> float32 [N, V]`.
    - `bind_token_map(token_map)` / `bind_tokenizer_dir(path)`: the engram's compressed vocabulary
      (needed before the first forward when the config has engram layers).
    `kv_cache_dtype` "fp8_fp4" (default) applies and stores the KV formats of MODEL_SPEC_V41 §5; "bf16"
    keeps the model dtype (no quantisation); the cache must be built with the same value. `trace.start()` / `trace.stop()` record per-layer picks and streams.
    The DSpark drafter (`mtp.*`) and the vision tower are not built.
    """

    def __init__(
        self,
        config: DeepseekV41Config,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
        *,
        kv_cache_dtype: KvCacheDtype = "fp8_fp4",
    ) -> None:
        super().__init__()
        self.trace = Trace()
        c = config.text_config
        self.kv_cache_dtype = kv_cache_dtype
        formats = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype)
        f = ModuleFactory(config, ops, dtype, device, KvQuantizer(ops, formats), self.trace)
        self.config, self.ops, self.dtype, self.device = config, ops, dtype, device
        self.embed = Embedding(f)
        self.layers = nn.ModuleList(Block(f, i) for i in range(c.num_hidden_layers))
        self.norm = f.norm(c.hidden_size)
        self.head = f.linear(c.hidden_size, c.vocab_size, quantizable=False)
        self.hasher: EngramHasher | None = None

    def bind_token_map(self, token_map: list[int]) -> None:
        self.hasher = EngramHasher(self.config.text_config, token_map)

    def bind_tokenizer_dir(self, checkpoint_dir: str | Path) -> None:
        self.bind_token_map(load_compressed_token_map(checkpoint_dir, self.config.text_config))

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, cache: DeepseekV41Cache, engram_rows: dict[int, torch.Tensor] | None = None
    ) -> ModelOutput:
        """`engram_rows` from `gather_engram_rows(batch, cache)` when the engine gathered them ahead."""
        c = self.config.text_config
        if cache.kv_cache_dtype != self.kv_cache_dtype:
            raise ValueError(f"cache stores kv_cache_dtype {cache.kv_cache_dtype!r} but the model was built for "
                             f"{self.kv_cache_dtype!r}; build both with the same value")
        if engram_rows is None:
            engram_rows = self.gather_engram_rows(batch, cache)
        streams = self.ops.embedding(batch.input_ids, self.embed.weight).unsqueeze(1).expand(-1, c.hc_mult, -1)
        streams = streams.contiguous()
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        state = ForwardState(batch)
        for layer in self.layers:
            streams, pre = layer(streams, pre, batch, cache, state, engram_rows.get(layer.layer))
        hidden = self.norm(self.ops.hc_collapse(streams, pre))
        self.trace.record("final_hidden", hidden)
        return ModelOutput(hidden, streams)

    def gather_engram_rows(
        self, batch: ForwardBatch, cache: DeepseekV41Cache, input_ids: torch.Tensor | None = None
    ) -> dict[int, torch.Tensor]:
        """Engram layer -> its table rows [T, cols*head_dim] on the model's device for the step's tokens.

        Depends only on the token ids (`input_ids` on the host when the caller has them, else read from
        `batch`): hashes on the host, advances `cache.engram_history` for the step's slots, gathers in
        host memory and moves only the gathered rows. Call it once per step, in step order.
        """
        c = self.config.text_config
        if not c.engram_layer_ids:
            return {}
        if self.hasher is None:
            raise RuntimeError(
                "DeepSeek-V4.1 engram layers need the tokenizer's compressed vocabulary: call "
                "`bind_tokenizer_dir(checkpoint_dir)` (or `bind_token_map`) before the first forward"
            )
        hash_ids = self.hasher.step(batch, cache.engram_history, input_ids)
        return {
            layer: self.layers[layer].engram.gather(hash_ids[:, k], self.device)
            for k, layer in enumerate(c.engram_layer_ids)
        }

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
