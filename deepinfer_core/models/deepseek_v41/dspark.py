"""DeepSeek-V4.1's DSpark drafter (MODEL_SPEC_V41 §10): three block stages, a Markov head, a confidence head.

Parameters carry the official names: `mtp.{k}.*` is a V4.1 block (sliding-window attention, MoE with
`dspark_n_routed_experts` experts and top-`dspark_num_experts_per_tok`, single-pass mHC);
`mtp.0.main_proj` / `mtp.0.main_norm` turn the target's hidden features into the context;
`mtp.{last}.norm`, `.markov_head.{embed,head}`, `.confidence_head.proj` read the block out. The
token embedding and the output head are the target's.

- Context: main_x = RMSNorm(main_norm)(main_proj(features)), features = the target's hidden at
  `target_layer_ids`, concatenated (`target_features`). Stage k's window K=V at a context position is
  FP8q(RoPE(kv_norm(wkv(main_x)))) with stage k's own weights (`context_kv`), cached by `DSparkCache`.
- Block (`block_hidden`): rows [anchor, noise x (N-1)] at positions L .. L+N-1 (L = the anchor's;
  N = the number of drafts, at most `dspark_block_size`, the block length the release was trained on).
  Every row attends, without a causal mask, to the whole block and to the context positions inside
  the sliding window of the block's last position, L+N-W .. L-1 (W = sliding_window). Returns each
  row's pre-norm collapsed hidden h_k (collapse with the last stage's FFN `pre`, no hc_head).
- Readout (`base_logits`, `markov`, `confidence`): U_k = head(RMSNorm(norm)(h_k)); with e = the Markov
  embedding of the previous token (the anchor for k = 0), logits_k = U_k + markov_head.head(e) and
  c_k = sigmoid(proj([h_k ; e])) in float32.

[inferred] (MODEL_SPEC_V41 marks these, or is silent, and this module follows the stated reading):
the target feature of a layer is the mean over the hc streams of that layer's input streams (the
attention input; a target layer may not be an engram layer, whose attention input differs); the
context window of the block is that of the block's last position (W-N context rows, W keys in all);
the block's streams start as n copies of the embedding with `pre` one-hot on stream 0, as the
target's layer 0; the Markov logits are added to U_k in float32; c_k pairs h_k with the embedding
used at step k; `dspark_target_layer_ids` is derived (the last three layers that are no KV source),
as the config parser drops a given value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.models.deepseek_v4.attention import output_projection
from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.kernel_ops import KernelOps

from .attention import Attention, store_in_ring
from .block import Block
from .config import DeepseekV41Config, DeepseekV41TextConfig
from .factory import ExpertFilter, ModuleFactory
from .kv_quant import Allocate, KvCacheDtype, KvQuantizer, StoredTensor, kv_formats
from .trace import Trace

__all__ = ["DSpark", "DSparkCache", "DSparkConfig", "DSparkUnavailable", "dspark_config"]

_TARGET_LAYERS = 3


class DSparkUnavailable(ValueError):
    """The config has no DSpark layers, or asks for a block the drafter cannot run."""


@dataclass(frozen=True, slots=True)
class DSparkConfig:
    num_stages: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int


def dspark_config(text: DeepseekV41TextConfig) -> DSparkConfig:
    """The `dspark_*` fields of a V4.1 text config (defaults: the release values)."""
    extra = text.model_extra or {}
    if text.num_nextn_predict_layers < 1:
        raise DSparkUnavailable("the config has num_nextn_predict_layers=0: this checkpoint has no DSpark layers "
                                "(`mtp.*`); turn speculative decoding off")
    non_sources = [i for i in range(text.num_hidden_layers) if i not in text.kv_source_layer_ids]
    targets = tuple(non_sources[-_TARGET_LAYERS:])
    engram_targets = [i for i in targets if i in text.engram_layer_ids]
    if engram_targets:
        raise DSparkUnavailable(f"DSpark target layers {engram_targets} are engram layers; the drafter reads the "
                                "input streams of its target layers, which an engram layer changes before attention")
    return DSparkConfig(
        num_stages=text.num_nextn_predict_layers,
        block_size=int(extra.get("dspark_block_size", 5)),
        noise_token_id=int(extra.get("dspark_noise_token_id", 128799)),
        target_layer_ids=targets,
        markov_rank=int(extra.get("dspark_markov_rank", 256)),
        n_routed_experts=int(extra.get("dspark_n_routed_experts", 128)),
        num_experts_per_tok=int(extra.get("dspark_num_experts_per_tok", 3)),
    )


class MarkovHead(nn.Module):
    """embed.weight [V, R] (the previous token's code), head.weight [V, R] (its logit correction)."""

    def __init__(self, f: ModuleFactory, rank: int) -> None:
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = f.param(f.config.vocab_size, rank)
        self.head = f.linear(rank, f.config.vocab_size, quantizable=False)


class ConfidenceHead(nn.Module):
    def __init__(self, f: ModuleFactory, rank: int) -> None:
        super().__init__()
        self.proj = f.linear(f.config.hidden_size + rank, 1, quantizable=False)


class DSparkStage(Block):
    """A V4.1 block at layer index num_hidden_layers + stage; the first stage also holds the context
    projection, the last one the readout."""

    def __init__(self, f: ModuleFactory, d: DSparkConfig, stage: int) -> None:
        super().__init__(f, f.config.num_hidden_layers + stage)
        c = f.config
        if stage == 0:
            self.main_proj = f.linear(len(d.target_layer_ids) * c.hidden_size, c.hidden_size, quantizable=True)
            self.main_norm = f.norm(c.hidden_size)
        if stage == d.num_stages - 1:
            self.norm = f.norm(c.hidden_size)
            self.markov_head = MarkovHead(f, d.markov_rank)
            self.confidence_head = ConfidenceHead(f, d.markov_rank)


class DSparkCache:
    """Per slot and stage, the window K=V of the context positions: `windows[k]` [num_slots, W] vectors of
    head_dim in the window KV format, position p at row p % W. Only context (accepted) positions are
    written; draft blocks are never stored."""

    def __init__(
        self, config: DeepseekV41Config, *, num_slots: int, dtype: torch.dtype,
        allocate: Allocate, kv_cache_dtype: KvCacheDtype = "fp8_fp4",
    ) -> None:
        c = config.text_config
        fmt = kv_formats(c.head_dim, c.index_head_dim, kv_cache_dtype).window
        self.windows = [
            StoredTensor(fmt, (num_slots, c.sliding_window), c.head_dim, dtype, allocate)
            for _ in range(dspark_config(c).num_stages)
        ]

    def store(self, ops: KernelOps, stage: int, kv: torch.Tensor, batch: ForwardBatch) -> None:
        """Each sequence's last min(q, W) context positions of `batch` go to their ring rows."""
        store_in_ring(ops, kv, batch, self.windows[stage])


class DSpark(nn.Module):
    """The drafter's weights and math, over the target's embedding and head (see the module docstring).

    - `context_kv(features [R, F], positions [R]) -> list of [R, head_dim]`, one per stage.
    - `block_hidden(block_ids [S, N], anchor_positions [S], rings) -> h [S, N, D]`: rings[k] is stage
      k's decoded window [S, W, head_dim] of the S sequences.
    - `base_logits(h [M, D]) -> float32 [M, V]`; `markov(prev [M]) -> (e [M, R], float32 [M, V])`;
      `confidence(h [M, D], e [M, R]) -> float32 [M]`.
    """

    def __init__(
        self,
        config: DeepseekV41Config,
        target: nn.Module,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
        *,
        kv_cache_dtype: KvCacheDtype = "fp8_fp4",
        expert_filter: ExpertFilter | None = None,
    ) -> None:
        super().__init__()
        text = config.text_config
        self.draft_config = d = dspark_config(text)
        stage_text = text.model_copy(update={"n_routed_experts": d.n_routed_experts,
                                             "num_experts_per_tok": d.num_experts_per_tok})
        stage_config = config.model_copy(update={"text_config": stage_text})
        formats = kv_formats(text.head_dim, text.index_head_dim, kv_cache_dtype)
        f = ModuleFactory(stage_config, ops, dtype, device, KvQuantizer(ops, formats), Trace(), expert_filter)
        self.config, self.ops, self.dtype = text, ops, dtype
        self.mtp = nn.ModuleList(DSparkStage(f, d, k) for k in range(d.num_stages))
        # NOTE: a plain attribute, not a submodule: the target's weights stay out of `mtp.*`'s state_dict.
        self.__dict__["target"] = target

    @property
    def first(self) -> DSparkStage:
        return self.mtp[0]

    @property
    def last(self) -> DSparkStage:
        return self.mtp[-1]

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        main_x = self.first.main_norm(self.first.main_proj(features.to(self.dtype)))
        out = []
        for stage in self.mtp:
            attn = stage.attn
            out.append(attn.kv.window(self.ops.rope(attn.kv_norm(attn.wkv(main_x)), positions, attn.inv_freq)))
        return out

    def block_hidden(
        self, block_ids: torch.Tensor, anchor_positions: torch.Tensor, rings: list[torch.Tensor]
    ) -> torch.Tensor:
        ops, c = self.ops, self.config
        num_seqs, n = block_ids.shape
        positions = (anchor_positions[:, None] + torch.arange(n, device=block_ids.device)).flatten()
        local = _block_batch(anchor_positions, n)
        streams = ops.embedding(block_ids.flatten(), self.target.embed.weight).unsqueeze(1)
        streams = streams.expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        hc = (c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        for stage, ring in zip(self.mtp, rings):
            pre_attn, post, comb = ops.hc_mix(streams, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, *hc)
            x = stage.attn_norm(ops.hc_collapse(streams, pre))
            streams = ops.hc_expand(_block_attention(stage.attn, x, positions, ring, local), streams, post, comb)
            pre, post, comb = ops.hc_mix(streams, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, *hc)
            ffn_out = stage.ffn(stage.ffn_norm(ops.hc_collapse(streams, pre_attn)))
            streams = ops.hc_expand(ffn_out, streams, post, comb)
        return ops.hc_collapse(streams, pre).view(num_seqs, n, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(self.last.norm(hidden))

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.last.markov_head
        e = self.ops.embedding(prev, head.embed.weight)
        return e, self.ops.logits(e, head.head.weight)

    def confidence(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        proj = self.last.confidence_head.proj
        joined = torch.cat([hidden.float(), e.float()], dim=-1)
        return torch.sigmoid(self.ops.linear(joined, proj.weight.float(), None, None)[:, 0])


def _block_batch(anchor_positions: torch.Tensor, n: int) -> ForwardBatch:
    """The block rows of S sequences as `sparse_attention` reads them: sequence i (slot i of the decoded
    rings) has context_len L_i and N rows, every one masked as the block's last position L_i + N - 1,
    which makes the block non-causal and the context window that of the block's end."""
    device = anchor_positions.device
    num_seqs = anchor_positions.shape[0]
    starts = anchor_positions.tolist()
    return ForwardBatch(
        input_ids=torch.zeros(num_seqs * n, dtype=torch.long, device=device),
        positions=(anchor_positions + n - 1).repeat_interleave(n),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * n,
        context_lens=anchor_positions.to(torch.int32),
        slot_ids=torch.arange(num_seqs, dtype=torch.int32, device=device),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=device),
        logits_indices=torch.arange(num_seqs * n, device=device),
        query_lens_cpu=[n] * num_seqs,
        context_lens_cpu=starts,
        slot_ids_cpu=list(range(num_seqs)),
        block_tables_cpu=[[0] for _ in range(num_seqs)],
    )


def _block_attention(
    attn: Attention, x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor, local: ForwardBatch
) -> torch.Tensor:
    """The stage's sliding-window attention (MODEL_SPEC_V41 §4 with ratio 0) over the block rows:
    RoPE at the rows' real positions, the mask of `_block_batch`."""
    ops = attn.ops
    q = ops.rope(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(-1, attn.n_heads, attn.head_dim), positions, attn.inv_freq)
    kv = attn.kv.window(ops.rope(attn.kv_norm(attn.wkv(x)), positions, attn.inv_freq))
    out = ops.sparse_attention(q, kv, ring, attn.attn_sink, attn.head_dim**-0.5, local)
    out = ops.rope(out, positions, attn.inv_freq, inverse=True)
    return output_projection(ops, out, out.shape[0], attn.o_groups, attn.wo_a, attn.wo_b)
