"""DeepSeek-V4.1 `config.json` -> typed config, with every layer's role spelled out.

The release ships a composite config (`model_type: deepseek_v41`: `text_config` + `vision_config` +
top-level `quantization_config`); a bare text config (`deepseek_v41_text`) is accepted too. Defaults
and derivations follow transformers' `DeepseekV41TextConfig` (MODEL_SPEC_V41 §1), with two release
spellings handled explicitly (§1.2): `engram_pad_token_id` is an alias of `engram_pad_id`, and a
`rope_scaling` dict keyed `type` instead of `rope_type` is rejected (transformers silently drops YaRN
for it).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deepinfer_core.model_config import (
    ModelConfigError, QuantizationConfig, RopeParams, raise_failed_checks, width_checks,
)
from deepinfer_core.models.deepseek_v41.engram_layout import engram_num_embeddings

__all__ = ["DeepseekV41TextConfig", "DeepseekV41VisionConfig", "DeepseekV41Config", "parse_deepseek_v41_config"]

_RELEASE_LAYERS = 40
_RELEASE_RATIOS = [0, 0] + [2] * 18 + [1] * 20
_RELEASE_KV_SOURCES = [2, 8, 14, 20]
_RELEASE_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]
_RELEASE_ENGRAM_LAYERS = [1, 14]


class DeepseekV41TextConfig(BaseModel):
    """The V4.1 text backbone. Derived per-layer lists are filled in before validation."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model_type: Literal["deepseek_v41_text"] = "deepseek_v41_text"
    vocab_size: int = Field(default=129280, gt=0)
    hidden_size: int = Field(default=5120, gt=0)
    num_hidden_layers: int = Field(default=40, gt=0)
    num_attention_heads: int = Field(default=64, gt=0)
    num_key_value_heads: Literal[1] = 1
    head_dim: int = Field(default=512, gt=0)
    q_lora_rank: int = Field(default=1280, gt=0)
    qk_rope_head_dim: int = Field(default=64, gt=0)
    o_groups: int = Field(default=8, gt=0)
    o_lora_rank: int = Field(default=1024, gt=0)
    max_position_embeddings: int = 1048576
    sliding_window: int = Field(default=128, gt=1)
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int = Field(default=2048, gt=0)
    candidate_block_size: int = Field(default=8, gt=0)
    index_n_heads: int = Field(default=32, gt=0)
    index_head_dim: int = Field(default=128, gt=0)
    index_topk: int = Field(default=512, gt=0)
    moe_intermediate_size: int = Field(default=2304, gt=0)
    n_routed_experts: int = Field(default=384, gt=0)
    num_experts_per_tok: int = Field(default=6, gt=0)
    scoring_func: Literal["sqrtsoftplus"] = "sqrtsoftplus"
    gate_temp: float = Field(default=1.0, gt=0)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = Field(default=4, gt=0)
    hc_sinkhorn_iters: int = Field(default=20, gt=0)
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int = Field(default=16000000, gt=1)
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int = Field(default=4, ge=2)
    engram_n_heads: int = Field(default=8, gt=0)
    engram_head_dim: int = Field(default=256, gt=0)
    engram_pad_id: int = Field(default=2, ge=0)
    engram_compressed_vocab_size: int = Field(default=99092, gt=0)
    num_nextn_predict_layers: int = Field(default=3, ge=0)
    rms_norm_eps: float = 1e-20
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_main: RopeParams
    rope_compress: RopeParams

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        out["model_type"] = "deepseek_v41_text"
        n = int(out.get("num_hidden_layers", _RELEASE_LAYERS))
        n_draft = int(out.get("num_nextn_predict_layers", 3))
        ratios = _compress_ratios(out.get("compress_ratios"), n, n_draft)
        out["compress_ratios"] = ratios
        kv_sources = out.get("kv_source_layer_ids")
        if kv_sources is None:
            kv_sources = _RELEASE_KV_SOURCES if ratios[:n] == _RELEASE_RATIOS else _first_of_runs(ratios[:n])
        out["kv_source_layer_ids"] = list(kv_sources)
        if out.get("index_source_layer_ids") is None:
            release = list(kv_sources) == _RELEASE_KV_SOURCES
            out["index_source_layer_ids"] = _RELEASE_INDEX_SOURCES if release else list(kv_sources)
        if out.get("candidate_source_layer_id") is None:
            out["candidate_source_layer_id"] = kv_sources[-1] if kv_sources else -1
        if out.get("engram_layer_ids") is None:
            out["engram_layer_ids"] = _RELEASE_ENGRAM_LAYERS if n == _RELEASE_LAYERS else []
        _alias(out, "engram_pad_token_id", "engram_pad_id")
        derived = engram_num_embeddings(
            layer_ids=out["engram_layer_ids"],
            max_ngram_size=int(out.get("engram_max_ngram_size", 4)),
            n_heads=int(out.get("engram_n_heads", 8)),
            vocab_size=int(out.get("engram_vocab_size", 16000000)),
        )
        given = out.get("engram_num_embeddings")
        if given is not None and list(given) != derived:
            raise ValueError(
                f"field `engram_num_embeddings` is {list(given)} but the prime layout of engram_layer_ids / "
                f"engram_max_ngram_size / engram_n_heads / engram_vocab_size gives {derived}; the hash ids would "
                "address the wrong rows. Fix the config or drop the field (it is derived)."
            )
        out["engram_num_embeddings"] = derived
        out["rope_main"], out["rope_compress"] = _rope_params(out)
        for derived_only in ("layer_types", "rope_parameters", "rope_scaling", "dspark_target_layer_ids"):
            out.pop(derived_only, None)
        return out

    @model_validator(mode="after")
    def _check(self) -> "DeepseekV41TextConfig":
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        for name, ids in (("kv_source_layer_ids", self.kv_source_layer_ids),
                          ("index_source_layer_ids", self.index_source_layer_ids),
                          ("engram_layer_ids", self.engram_layer_ids)):
            bad = [i for i in ids if not 0 <= i < n]
            if bad or list(ids) != sorted(set(ids)):
                raise ValueError(f"field `{name}` must be increasing layer ids in [0, {n}); got {list(ids)}")
        for i in self.kv_source_layer_ids:
            if ratios[i] < 1:
                raise ValueError(f"field `kv_source_layer_ids`: layer {i} has compress ratio 0; a source needs >= 1")
        for i in range(n):
            if ratios[i] == 0:
                continue
            source = self.kv_source_of(i)
            if source is None:
                raise ValueError(f"field `compress_ratios`: layer {i} has ratio {ratios[i]} but no KV source at or "
                                 f"before it (kv_source_layer_ids={list(self.kv_source_layer_ids)})")
            if ratios[i] != ratios[source]:
                raise ValueError(f"field `compress_ratios`: layer {i} has ratio {ratios[i]} but its band's KV source "
                                 f"{source} has ratio {ratios[source]}; a band shares one set of compressed entries")
        missing = [i for i in self.kv_source_layer_ids if i not in self.index_source_layer_ids]
        if missing:
            raise ValueError(f"field `index_source_layer_ids`: KV sources {missing} are not index sources; a band's "
                             "indexer keys come from its source's indexer (`wk`, `k_norm`)")
        for i in self.index_source_layer_ids:
            if ratios[i] < 1:
                raise ValueError(f"field `index_source_layer_ids`: layer {i} has compress ratio 0")
        candidate = self.candidate_source_layer_id
        if candidate >= 0:
            if candidate not in self.index_source_layer_ids:
                raise ValueError(f"field `candidate_source_layer_id`: {candidate} is not an index source "
                                 f"({list(self.index_source_layer_ids)})")
            later = [i for i in self.index_source_layer_ids if i > candidate]
            foreign = [i for i in later if self.kv_source_of(i) != self.kv_source_of(candidate)]
            if foreign:
                raise ValueError(f"field `candidate_source_layer_id`: index sources {foreign} come after candidate "
                                 f"source {candidate} but score another band's entries; the candidate mask cannot "
                                 "apply to them")
        raise_failed_checks([
            *width_checks(self),
            (0 <= self.engram_pad_id < self.vocab_size, "engram_pad_id",
             f"{self.engram_pad_id} is not a token id below vocab_size={self.vocab_size}"),
        ])
        return self

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose band holds `layer` (the latest source at or before it), None for ratio 0."""
        if self.compress_ratios[layer] == 0:
            return None
        sources = [s for s in self.kv_source_layer_ids if s <= layer]
        return sources[-1] if sources else None

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source picks inside the candidate blocks."""
        return layer in self.index_source_layer_ids and 0 <= self.candidate_source_layer_id < layer

    @property
    def band_ratios(self) -> dict[int, int]:
        """KV source layer -> compress ratio of its band."""
        return {s: self.compress_ratios[s] for s in self.kv_source_layer_ids}


class DeepseekV41VisionConfig(BaseModel):
    """The vision tower and aligner (MODEL_SPEC_V41 §11); defaults are the release values."""

    model_config = ConfigDict(extra="allow", frozen=True)

    hidden_size: int = Field(default=1024, gt=0)
    intermediate_size: int = Field(default=2816, gt=0)
    num_hidden_layers: int = Field(default=32, ge=0)
    num_attention_heads: int = Field(default=16, gt=0)
    patch_size: int = Field(default=14, gt=0)
    downsample_ratio: int = Field(default=3, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    max_image_tokens: int = Field(default=1024, ge=4)
    min_pixels: int = Field(default=295936, ge=0)
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6

    @model_validator(mode="after")
    def _check(self) -> "DeepseekV41VisionConfig":
        heads = self.num_attention_heads
        if self.hidden_size % heads or (self.hidden_size // heads) % 4:
            raise ValueError(f"field `vision_config.num_attention_heads`: hidden_size {self.hidden_size} / {heads} "
                             "heads must be a whole head_dim divisible by 4 (2D RoPE rotates head_dim/4 pairs per axis)")
        return self


class DeepseekV41Config(BaseModel):
    """The composite release config: the text backbone, and the vision tower when `vision_config` is given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model_type: Literal["deepseek_v41"] = "deepseek_v41"
    text_config: DeepseekV41TextConfig
    vision_config: DeepseekV41VisionConfig | None = None
    quantization_config: QuantizationConfig | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool = False

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self.text_config.eos_token_id

    @property
    def max_position_embeddings(self) -> int:
        return self.text_config.max_position_embeddings


def parse_deepseek_v41_config(raw: dict[str, Any]) -> DeepseekV41Config:
    """Typed config from a composite (`deepseek_v41`) or bare text (`deepseek_v41_text`) config dict.

    Raises ModelConfigError naming the offending field.
    """
    composite = dict(raw) if raw.get("text_config") is not None else {"text_config": dict(raw)}
    composite["model_type"] = "deepseek_v41"
    composite.pop("architectures", None)
    quant = composite.get("quantization_config")
    if isinstance(quant, dict):
        quant = dict(quant)
        if quant.get("quant_method") != "fp8":
            raise ModelConfigError(f"config.json field `quantization_config.quant_method` is "
                                   f"{quant.get('quant_method')!r}; DeepSeek-V4.1 checkpoints are 'fp8'")
        quant.setdefault("weight_block_size", [32, 32])
        composite["quantization_config"] = quant
    try:
        return DeepseekV41Config(**composite)
    except ValidationError as err:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) or "text_config" for e in err.errors())
        raise ModelConfigError(f"invalid DeepSeek-V4.1 config.json, field(s) {fields}: {err}") from err
    except ValueError as err:
        raise ModelConfigError(f"invalid DeepSeek-V4.1 config.json: {err}") from err


def _compress_ratios(given: Any, n: int, n_draft: int) -> list[int]:
    if given is None:
        if n == _RELEASE_LAYERS:
            ratios = list(_RELEASE_RATIOS)
        else:
            head = min(2, n)
            pooled = math.ceil((n - head) / 2)
            ratios = [0] * head + [2] * pooled + [1] * (n - head - pooled)
    else:
        ratios = [int(r) for r in given]
    if not n <= len(ratios) <= n + n_draft:
        raise ValueError(f"field `compress_ratios` has {len(ratios)} entries; expected between num_hidden_layers={n} "
                         f"and num_hidden_layers + num_nextn_predict_layers={n + n_draft}")
    if any(r < 0 for r in ratios):
        raise ValueError(f"field `compress_ratios` holds a negative ratio: {ratios}")
    return ratios + [0] * (n + n_draft - len(ratios))


def _first_of_runs(ratios: list[int]) -> list[int]:
    return [i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r)]


def _alias(out: dict[str, Any], release_name: str, name: str) -> None:
    if release_name not in out:
        return
    value = out.pop(release_name)
    if out.get(name) is not None and out[name] != value:
        raise ValueError(f"fields `{release_name}`={value} and `{name}`={out[name]} disagree; they name the same "
                         "token (the engram pad), keep one")
    out[name] = value


def _rope_params(out: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    nested = out.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        return _one_rope(nested["main"], "rope_parameters.main"), _one_rope(nested["compress"], "rope_parameters.compress")
    scaling = dict(out.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        raise ValueError(
            f"field `rope_scaling` uses the key `type` ({scaling['type']!r}); DeepSeek-V4.1 reads `rope_type`, and "
            "transformers silently drops YaRN for `type`. Rename the key to `rope_type`."
        )
    main = RopeParams(rope_theta=float(out.get("rope_theta", 10000.0)))
    scaling["rope_theta"] = float(out.get("compress_rope_theta", 160000.0))
    return main, _one_rope(scaling, "rope_scaling")


def _one_rope(params: dict[str, Any], field: str) -> RopeParams:
    params = {k: v for k, v in params.items() if k not in ("partial_rotary_factor", "attention_factor", "type")}
    rope_type = params.pop("rope_type", None) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"field `{field}` has rope type {rope_type!r}; expected 'default' or 'yarn'")
    if rope_type == "yarn" and params.get("original_max_position_embeddings") is None:
        raise ValueError(f"field `{field}` is yarn but lacks `original_max_position_embeddings`")
    params = {k: v for k, v in params.items() if v is not None}
    return RopeParams(rope_type=rope_type, **params)
