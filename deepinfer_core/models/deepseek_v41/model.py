"""DeepseekV41ForCausalLM: embedding (with image spans), engram, single-pass mHC blocks, final collapse, norm, head."""

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
from .factory import ExpertFilter, ModuleFactory
from .image_span import StepImages, llm_grid, span_vectors
from .kv_quant import KvCacheDtype, KvQuantizer, kv_formats
from .trace import Trace
from .vision import Aligner, VisionTower

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
      token-only engram part (hashed on the device, rows read from the host tables).
    - `compute_logits(hidden [N, D]) -> float32 [N, V]`.
    - `bind_token_map(token_map)` / `bind_tokenizer_dir(path)`: the engram's compressed vocabulary
      (needed before the first forward when the config has engram layers).
    `kv_cache_dtype` "fp8_fp4" (default) applies and stores the KV formats of MODEL_SPEC_V41 §5; "bf16"
    keeps the model dtype (no quantisation); the cache must be built with the same value.
    With `expert_filter(layer, expert)` (expert parallelism) the model holds only those routed experts,
    as V4's does. `trace.start()` / `trace.stop()` record per-layer picks and streams.
    With `vision=True` (the checkpoint holds `vision.*`, `aligner.*`, `image_*`) the vision tower is built:
    `embed_images(patches, grids)` gives each image's span vectors, and `forward(..., images=StepImages)`
    puts them in place of the span rows' embeddings (MODEL_SPEC_V41 §11; no reference run of this path exists).
    The DSpark drafter (`mtp.*`) is not built here: speculative decoding builds and loads it (dspark.py),
    so the loader skips those tensors for this model.
    """

    skipped_checkpoint_prefixes = ("mtp.",)
    # A plain decode step reads no per-sequence host values (the compressor, indexer, window store and engram
    # hash take their decode paths, `ForwardBatch.is_plain_decode`) on a backend whose ops size their work
    # from the device tensors, so the engine may replay it from a device graph (engine/decode_graphs.py).
    decode_graphs = True

    def __init__(
        self,
        config: DeepseekV41Config,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
        *,
        kv_cache_dtype: KvCacheDtype = "fp8_fp4",
        expert_filter: ExpertFilter | None = None,
        vision: bool = False,
    ) -> None:
        super().__init__()
        self.trace = Trace()
        c = config.text_config
        self.kv_cache_dtype = kv_cache_dtype
        formats = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype)
        f = ModuleFactory(config, ops, dtype, device, KvQuantizer(ops, formats), self.trace, expert_filter)
        self.config, self.ops, self.dtype, self.device = config, ops, dtype, device
        self.embed = Embedding(f)
        self.layers = nn.ModuleList(Block(f, i) for i in range(c.num_hidden_layers))
        self.norm = f.norm(c.hidden_size)
        self.head = f.linear(c.hidden_size, c.vocab_size, quantizable=False)
        self.hasher: EngramHasher | None = None
        self.vision: VisionTower | None = None
        if vision:
            self._build_vision(f)

    def _build_vision(self, f: ModuleFactory) -> None:
        config = self.config
        if config.vision_config is None or config.image_token_id is None:
            missing = "vision_config" if config.vision_config is None else "image_token_id"
            raise ValueError(f"vision=True needs `vision_config` and `image_token_id` in the DeepSeek-V4.1 "
                             f"config.json, which has no {missing}")
        hidden = config.text_config.hidden_size
        self.vision = VisionTower(config.vision_config, self.ops, self.dtype, self.device)
        self.aligner = Aligner(config.vision_config, hidden, self.ops, self.dtype, self.device)
        self.image_start = f.param(hidden)
        self.image_newline = f.param(hidden)
        self.image_end = f.param(hidden)

    @torch.no_grad()
    def embed_images(self, patches: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image's span vectors [span_length, D] (model dtype) from its patches [h*w, 3*p*p] and grid (h, w)."""
        if self.vision is None:
            raise ValueError("this DeepSeek-V4.1 model was built without its vision tower (vision=False, or the "
                             "checkpoint has no `vision.*` weights); it cannot take images")
        features = self.vision(torch.cat(patches).to(self.device), grids).split([h * w for h, w in grids])
        ratio = self.config.vision_config.downsample_ratio
        spans = []
        for image, grid in zip(features, grids):
            rows, cols = llm_grid(*grid, ratio)
            spans.append(span_vectors(self.aligner(image, grid), rows, cols, self.image_start, self.image_newline,
                                      self.image_end))
        return spans

    def bind_token_map(self, token_map: list[int]) -> None:
        self.hasher = EngramHasher(self.config.text_config, self.ops, token_map)

    def bind_tokenizer_dir(self, checkpoint_dir: str | Path) -> None:
        self.bind_token_map(load_compressed_token_map(checkpoint_dir, self.config.text_config))

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        cache: DeepseekV41Cache,
        images: StepImages | None = None,
    ) -> ModelOutput:
        """`images`: the step's image-span rows."""
        c = self.config.text_config
        if cache.kv_cache_dtype != self.kv_cache_dtype:
            raise ValueError(f"cache stores kv_cache_dtype {cache.kv_cache_dtype!r} but the model was built for "
                             f"{self.kv_cache_dtype!r}; build both with the same value")
        engram_rows = self.gather_engram_rows(batch, cache, None if images is None else images.rows_cpu)
        x = self.ops.embedding(batch.input_ids, self.embed.weight)
        if images is not None:
            x = x.index_copy(0, images.rows, images.vectors.to(x.dtype))
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        state = ForwardState(batch)
        state.image_rows = None if images is None else images.rows
        for layer in self.layers:
            streams, pre = layer(streams, pre, batch, cache, state, engram_rows.get(layer.layer))
        hidden = self.norm(self.ops.hc_collapse(streams, pre))
        self.trace.record("final_hidden", hidden)
        return ModelOutput(hidden, streams)

    def gather_engram_rows(
        self,
        batch: ForwardBatch,
        cache: DeepseekV41Cache,
        dead_rows: list[int] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Engram layer -> its table rows [T, cols*head_dim] on the model's device for the step's tokens.

        Hashes the step's device token ids on the device and advances `cache.engram_history` for the
        step's slots; `KernelOps.gather_rows` reads the rows from the host tables. Nothing here waits
        for the host, so a step that feeds back the token in flight queues without a sync. Called once
        per step, in step order. `dead_rows`: rows that are image-span tokens (DEAD in the history).
        """
        c = self.config.text_config
        if not c.engram_layer_ids:
            return {}
        if self.hasher is None:
            raise RuntimeError(
                "DeepSeek-V4.1 engram layers need the tokenizer's compressed vocabulary: call "
                "`bind_tokenizer_dir(checkpoint_dir)` (or `bind_token_map`) before the first forward"
            )
        hash_ids = self.hasher.step(batch, cache.engram_history, dead_rows=dead_rows)
        return {
            layer: self.layers[layer].engram.gather(hash_ids[:, k])
            for k, layer in enumerate(c.engram_layer_ids)
        }

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(hidden, self.head.weight)
