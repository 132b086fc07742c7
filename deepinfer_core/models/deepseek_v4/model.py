"""DeepseekV4ForCausalLM: embedding, hyper-connected blocks, hyper-head, norm, head; plus MTP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.model_config import DeepseekV4Config
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

from .block import Block
from .cache import DeepseekV4Cache
from .factory import ExpertFilter, ModuleFactory
from .mtp import MTPBlock
from .step_rows import StepRows

__all__ = ["DeepseekV4ForCausalLM", "ModelOutput", "MtpOutput"]


@dataclass(slots=True)
class ModelOutput:
    hidden: torch.Tensor   # [T, D] final normalised hidden states (input of `compute_logits`)
    streams: torch.Tensor  # [T, hc_mult, D] residual streams after the last block (input of MTP)


@dataclass(slots=True)
class MtpOutput:
    logits: torch.Tensor   # [N, V] float32, distribution of the token after `next_token_ids`
    streams: torch.Tensor  # [N, hc_mult, D] MTP output streams (the H of a further draft step)


class Embedding(nn.Module):
    def __init__(self, f: ModuleFactory) -> None:
        super().__init__()
        self.weight = f.param(f.config.vocab_size, f.config.hidden_size)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 over a flat token batch, written against `KernelOps` only.

    Parameters carry the official checkpoint names (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
    `mtp.0.e_proj.weight`, ...), allocated empty: fill them with `weights.loader.load_model_weights`.
    With `expert_filter(block, expert)` (expert parallelism; MTP block k is num_hidden_layers + k) the
    model holds only those routed experts; each MoE then returns its held experts' share plus the
    shared expert, and the caller combines ranks. `step_rows` (on the model and each main layer's
    attention) decides which rows of a step this process computes: all, unless context parallelism
    (`deepinfer_core.distributed.context_parallel`) replaces it.

    - `forward(batch, cache) -> ModelOutput(hidden [T, D], streams [T, hc_mult, D])` runs every token
      of the step and updates `cache` (a `DeepseekV4Cache`) for them.
    - `compute_logits(hidden [N, D]) -> float32 [N, V]`.
    - `mtp_forward(streams, next_token_ids, batch, cache, layer=0) -> MtpOutput`: row r of `streams`
      is the main model's output streams at position batch.positions[r], `next_token_ids[r]` the token
      at the next position; returns logits for the token after that. `batch` describes these rows
      (positions, slots, context_lens of the MTP layer's own window); `batch.input_ids` is not read.
    """

    # A decode step's forward reads no per-sequence host values on a backend whose ops size their work
    # from the device tensors (engine/decode_graphs.py), so the engine may replay it from a device graph.
    decode_graphs = True

    def __init__(
        self,
        config: DeepseekV4Config,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
        *,
        expert_filter: ExpertFilter | None = None,
    ) -> None:
        super().__init__()
        f = ModuleFactory(config, ops, dtype, device, expert_filter)
        self.config, self.ops, self.dtype = config, ops, dtype
        self.embed = Embedding(f)
        self.layers = nn.ModuleList(Block(f, spec, i) for i, spec in enumerate(config.layers))
        self.norm = f.norm(config.hidden_size)
        self.head = f.linear(config.hidden_size, config.vocab_size, quantizable=False)
        self.hc_head_fn = f.param(config.hc_mult, config.hc_mult * config.hidden_size, dtype=torch.float32)
        self.hc_head_base = f.param(config.hc_mult, dtype=torch.float32)
        self.hc_head_scale = f.param(1, dtype=torch.float32)
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPBlock(f, spec, n + k) for k, spec in enumerate(config.mtp_layers))
        self.step_rows = StepRows()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: DeepseekV4Cache) -> ModelOutput:
        c = self.config
        batch = self.step_rows.begin(batch)
        streams = self.ops.hc_embedding(batch.input_ids, self.embed.weight, c.hc_mult)
        for layer, layer_cache in zip(self.layers, cache.layers):
            streams = layer(streams, batch.input_ids, batch, layer_cache)
        head = self.ops.hc_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, c.hc_eps
        )
        return ModelOutput(*self.step_rows.gather(self.norm(head), streams))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(hidden, self.head.weight)

    @torch.no_grad()
    def mtp_forward(
        self,
        streams: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: DeepseekV4Cache,
        layer: int = 0,
    ) -> MtpOutput:
        embeds = self.ops.embedding(next_token_ids, self.embed.weight)
        layer_cache = cache.layers[self.config.num_hidden_layers + layer]
        out, hidden = self.mtp[layer].draft(streams, embeds, next_token_ids, batch, layer_cache)
        return MtpOutput(self.compute_logits(hidden), out)
