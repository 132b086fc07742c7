"""User-facing engine configuration: typed, validated, and every error names its field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer_core import envs
from deepinfer_core.speculative.config import SpeculativeConfig

__all__ = ["EngineConfig", "ParallelConfig", "PrefixCachingConfig", "SchedulerConfig"]


class SchedulerConfig(BaseModel):
    """How many sequences and tokens one engine step may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(
        8192, ge=1, description="Token budget of one step; longer prompts are prefilled in chunks."
    )
    async_scheduling: bool = Field(
        True, description="Prepare step N+1 on the host while the device runs step N."
    )


class ParallelConfig(BaseModel):
    """How many processes serve one `LLM` and how the model is split over them.

    Ranks: `dp` when dp > 1 (ep must divide it: EP groups of `ep` consecutive DP ranks), else `ep`,
    or `cp` for context parallelism (which does not combine with ep or dp > 1 yet).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ep: int = Field(1, ge=1, description="Expert parallelism: ranks each MoE layer's experts are spread over.")
    dp: int = Field(
        1, ge=1, description="Attention data parallelism: ranks that each own a share of the requests and their "
        "own KV cache; 1 = every rank runs every request.",
    )
    cp: int = Field(1, ge=1, description="Context parallelism: ranks a prefill's tokens are split over.")
    num_redundant_experts: int = Field(
        0, ge=0, description="Extra expert slots per MoE layer of an EP group, holding copies of busy experts.",
    )
    eplb_interval_steps: int | None = Field(
        None, ge=1, description="Re-place experts by the observed load every this many steps; None = never.",
    )
    timeout_s: float = Field(
        600.0, gt=0.0, description="Longest a rank may wait in one collective, and spawned ranks to load the model.",
    )

    @property
    def world_size(self) -> int:
        if self.cp > 1:
            return self.cp
        return self.dp if self.dp > 1 else self.ep


class PrefixCachingConfig(BaseModel):
    """Reuse of the cached state of earlier prompts' prefixes (engine/prefix_cache.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="Start a new request after the longest cached prefix of its prompt. Off by default: "
        "exact mode ends one prefill chunk at each prompt's last block boundary (one more step before the "
        "first token) and keeps a slot-sized window snapshot per cached prompt.",
    )
    reuse: Literal["exact", "bounded"] = Field(
        "exact", description="exact: restore every layer's window state from a snapshot (same output as "
        "without reuse); bounded: recompute the hit's last decoder_replay_span tokens with no window KV "
        "before them (approximate; DeepSeek-V4.1 only).",
    )
    decoder_replay_span: int = Field(140, ge=0, description="bounded mode: tokens of a hit recomputed.")
    num_snapshots: int | None = Field(
        None, ge=1, description="exact mode: window snapshots kept (each costs one sequence slot of KV memory); "
        "None = max_num_seqs.",
    )


class EngineConfig(BaseModel):
    """Everything `LLM(...)` needs to build an engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="Local checkpoint directory or hub id; None uses DEEPINFER_HF_MODEL_DIR."
    )
    accelerator: str | None = Field(
        None, description="Backend name; None uses DEEPINFER_ACCELERATOR or the best available."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Activation dtype; auto = the checkpoint's torch_dtype."
    )
    seed: int = Field(0, ge=0, description="Seed from which unseeded requests derive theirs.")
    kv_cache_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Share of the device memory left free after loading that the KV pool may use.",
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Exact KV block count; overrides kv_cache_memory_fraction."
    )
    block_size: int | None = Field(
        None, ge=1, description="Tokens per KV block; None = the model's smallest valid size."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; None = the model's max positions."
    )
    kv_cache_dtype: Literal["auto", "bf16", "fp8_fp4"] = Field(
        "auto",
        description="KV-cache storage format: auto = the model's own (fp8/fp4 for DeepSeek-V4.1, the model "
        "dtype for V4); bf16 = the model dtype, unquantised (V4.1's debugging/parity mode); fp8_fp4 = V4.1's "
        "fp8 window and fp4 compressed KV.",
    )
    batch_invariant: bool = Field(
        default_factory=envs.batch_invariant,
        description="Bitwise-identical logits for a request whatever else is in the batch; the backend must "
        "claim the batch_invariant capability. Default: DEEPINFER_BATCH_INVARIANT.",
    )
    fp8_activations: bool = Field(
        False,
        description="Quantise the inputs of fp8-weight projections and experts to fp8 (per token and 128-column "
        "block, power-of-two scales) and run fp8 matrix products (W8A8), as DeepSeek's own inference does. Off: "
        "fp8 weights meet activations in the model dtype (W8A16), computing what the dequantised bf16 reference "
        "computes. Needs a checkpoint with fp8 weights.",
    )
    enforce_eager: bool = Field(
        False,
        description="Launch every decode step op by op; by default a backend with graphs replays decode steps "
        "of a model that supports it from captured device graphs (engine/decode_graphs.py).",
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = Field(
        None, description="Draft with the checkpoint's MTP layer and verify in one step; None = off."
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    prefix_caching: PrefixCachingConfig = Field(default_factory=PrefixCachingConfig)

