"""`config.json` -> typed model config, with every per-layer choice made explicit.

Both config forms are accepted: transformers' (`layer_types`, `mlp_layer_types`, `compress_rates`)
and the official release's (`compress_ratios` per layer with the MTP layers' entries last,
`num_hash_layers`, `compress_rate_csa` / `compress_rate_hca`, `qk_rope_head_dim`, `rope_scaling`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ModelConfigError",
    "UnsupportedModelError",
    "RopeParams",
    "LayerSpec",
    "QuantizationConfig",
    "DeepseekV4Config",
    "ModelConfig",
    "load_model_config",
    "raise_failed_checks",
    "width_checks",
]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class ModelConfigError(ValueError):
    """config.json is missing a field or holds an inconsistent value."""


class UnsupportedModelError(ModelConfigError):
    """config.json names a model type DeepInfer does not run."""


class RopeParams(BaseModel):
    """One RoPE variant. `rope_type` "default" or "yarn" (yarn keys as in transformers)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    rope_type: Literal["default", "yarn"] = "default"
    rope_theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class LayerSpec(BaseModel):
    """What one decoder block (main or MTP) is: its attention type, compress ratio, MoE type."""

    model_config = ConfigDict(frozen=True)

    attention: Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    compress_ratio: int = Field(ge=0)
    mlp: Literal["hash_moe", "moe"]

    @property
    def is_compressed(self) -> bool:
        return self.attention != SLIDING


class QuantizationConfig(BaseModel):
    """`quantization_config` of an fp8 checkpoint (e4m3 weights, power-of-two block scales)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)


class DeepseekV4Config(BaseModel):
    """DeepSeek-V4 config, normalised: `layers` / `mtp_layers` spell out every block's type."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model_type: Literal["deepseek_v4"] = "deepseek_v4"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    q_lora_rank: int = Field(gt=0)
    o_groups: int = Field(gt=0)
    o_lora_rank: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = Field(gt=0)
    index_n_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    index_topk: int = Field(gt=0)
    hc_mult: int = Field(gt=0)
    hc_sinkhorn_iters: int = Field(gt=0)
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = Field(default=1, ge=0)
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    layers: tuple[LayerSpec, ...]
    mtp_layers: tuple[LayerSpec, ...]
    rope_main: RopeParams
    rope_compress: RopeParams
    quantization_config: QuantizationConfig | None = None
    expert_dtype: Literal["fp4"] | None = None

    @model_validator(mode="after")
    def _check_shapes(self) -> "DeepseekV4Config":
        checks = [
            (len(self.layers) == self.num_hidden_layers, "layers",
             f"{len(self.layers)} layer specs for num_hidden_layers={self.num_hidden_layers}"),
            (len(self.mtp_layers) == self.num_nextn_predict_layers, "mtp_layers",
             f"{len(self.mtp_layers)} MTP specs for num_nextn_predict_layers={self.num_nextn_predict_layers}"),
            *width_checks(self),
        ]
        raise_failed_checks(checks)
        for spec in (*self.layers, *self.mtp_layers):
            if spec.is_compressed and spec.compress_ratio < 1:
                raise ValueError(f"field `layers`: {spec.attention} needs a compress ratio >= 1")
        return self

    @property
    def all_layers(self) -> tuple[LayerSpec, ...]:
        """Main layers then MTP layers; MTP layer j has index num_hidden_layers + j."""
        return self.layers + self.mtp_layers

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({s.compress_ratio for s in self.all_layers if s.is_compressed}))


ModelConfig = DeepseekV4Config


def load_model_config(path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
    """Read a model directory, a config.json path or a dict, and return the typed config.

    `deepseek_v41` configs (composite or text-only) return a `DeepseekV41Config`. Raises
    UnsupportedModelError for other model types and ModelConfigError naming the field for missing or
    inconsistent values.
    """
    raw = _read_raw(path_or_dict)
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type in ("deepseek_v41", "deepseek_v41_text") or "DeepseekV41ForCausalLM" in architectures:
        from deepinfer_core.models.deepseek_v41.config import parse_deepseek_v41_config

        return parse_deepseek_v41_config(raw)
    if model_type != "deepseek_v4" and "DeepseekV4ForCausalLM" not in architectures:
        raise UnsupportedModelError(
            f"config.json field `model_type` is {model_type!r} (architectures {architectures}); DeepInfer runs "
            "`deepseek_v4` only. Point the engine at a DeepSeek-V4 checkpoint."
        )
    try:
        return DeepseekV4Config(**_normalise_v4(raw))
    except ValidationError as err:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) or "config" for e in err.errors())
        raise ModelConfigError(f"invalid DeepSeek-V4 config.json, field(s) {fields}: {err}") from err


def _read_raw(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json at {path}: expected a model directory or a config.json file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path} is not valid JSON: {err}") from err


def _require(raw: dict[str, Any], name: str) -> Any:
    if raw.get(name) is None:
        raise ModelConfigError(f"config.json is missing the required field `{name}`")
    return raw[name]


def _normalise_v4(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    out["model_type"] = "deepseek_v4"
    n = int(_require(raw, "num_hidden_layers"))
    n_mtp = int(raw.get("num_nextn_predict_layers", 1))
    head_dim = int(_require(raw, "head_dim"))
    out["qk_rope_head_dim"] = _rope_head_dim(raw, head_dim)
    rates = _compress_rates(raw)
    attention = _attention_types(raw, n, n_mtp)
    mlp = _mlp_types(raw, n)
    specs = [
        LayerSpec(attention=a, compress_ratio=0 if a == SLIDING else rates[a], mlp=m)
        for a, m in zip(attention, mlp + ["moe"] * n_mtp)
    ]
    out["layers"], out["mtp_layers"] = specs[:n], specs[n:]
    out["rope_main"], out["rope_compress"] = _rope_params(raw)
    out["quantization_config"] = raw.get("quantization_config") or None
    expert_dtype = raw.get("expert_dtype") or (out["quantization_config"] or {}).get("expert_dtype")
    out["expert_dtype"] = expert_dtype
    for legacy in ("layer_types", "mlp_layer_types", "compress_rates", "compress_ratios", "rope_parameters",
                   "rope_scaling", "num_hash_layers", "compress_rate_csa", "compress_rate_hca",
                   "partial_rotary_factor"):
        out.pop(legacy, None)
    if isinstance(out["quantization_config"], dict) and out["quantization_config"].get("quant_method") != "fp8":
        raise ModelConfigError(
            f"config.json field `quantization_config.quant_method` is "
            f"{out['quantization_config'].get('quant_method')!r}; only 'fp8' (e4m3, block scales) is supported"
        )
    return out


def _rope_head_dim(raw: dict[str, Any], head_dim: int) -> int:
    if raw.get("qk_rope_head_dim") is not None:
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    return int(head_dim * factor) if factor is not None else head_dim * 64 // 512


def _compress_rates(raw: dict[str, Any]) -> dict[str, int]:
    rates = dict(_DEFAULT_RATES)
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = int(raw["compress_rate_hca"])
    return rates


def _attention_types(raw: dict[str, Any], n: int, n_mtp: int) -> list[str]:
    total = n + n_mtp
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
        if len(types) < n:
            raise ModelConfigError(f"config.json field `layer_types` has {len(types)} entries, expected {n}")
        types = types[:n] + [SLIDING] * n_mtp
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        if len(ratios) < n:
            raise ModelConfigError(f"config.json field `compress_ratios` has {len(ratios)} entries, expected >= {n}")
        ratios = ratios[:total] + [0] * max(0, total - len(ratios))
        to_type = dict(_RATIO_TO_TYPE)
        for name, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if raw.get(key) is not None:
                to_type.setdefault(int(raw[key]), name)
        unknown = sorted({r for r in ratios if r not in to_type})
        if unknown:
            raise ModelConfigError(
                f"config.json field `compress_ratios` holds {unknown}; expected 0 (sliding), 4 (CSA) or 128 (HCA)"
            )
        types = [to_type[r] for r in ratios]
    else:
        raise ModelConfigError("config.json needs `layer_types` or `compress_ratios` to say each layer's attention")
    bad = sorted({t for t in types if t not in ATTENTION_TYPES})
    if bad:
        raise ModelConfigError(f"config.json field `layer_types` holds {bad}; expected one of {ATTENTION_TYPES}")
    return types


def _mlp_types(raw: dict[str, Any], n: int) -> list[str]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:n]
        if len(types) != n or any(t not in MLP_TYPES for t in types):
            raise ModelConfigError(
                f"config.json field `mlp_layer_types` must list {n} entries from {MLP_TYPES}; got {types}"
            )
        return types
    n_hash = int(raw.get("num_hash_layers", 3))
    return ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)


def _rope_params(raw: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = nested["main"], nested["compress"]
        return _one_rope(main, "rope_parameters.main"), _one_rope(compress, "rope_parameters.compress")
    scaling = dict(raw.get("rope_scaling") or (nested if isinstance(nested, dict) else {}) or {})
    main = RopeParams(rope_theta=float(raw.get("rope_theta", 10000.0)))
    scaling["rope_theta"] = float(raw.get("compress_rope_theta", 160000.0))
    return main, _one_rope(scaling, "rope_scaling")


def _one_rope(params: dict[str, Any], field: str) -> RopeParams:
    params = {k: v for k, v in params.items() if k not in ("partial_rotary_factor", "attention_factor")}
    legacy_type, rope_type = params.pop("type", None), params.pop("rope_type", None)
    rope_type = rope_type or legacy_type or "default"
    if rope_type not in ("default", "yarn"):
        raise ModelConfigError(f"config.json field `{field}` has rope type {rope_type!r}; expected 'default' or 'yarn'")
    if rope_type == "yarn" and params.get("original_max_position_embeddings") is None:
        raise ModelConfigError(f"config.json field `{field}` is yarn but lacks `original_max_position_embeddings`")
    for key in ("beta_fast", "beta_slow", "factor"):
        if params.get(key) is None:
            params.pop(key, None)
    return RopeParams(rope_type=rope_type, **params)


def width_checks(c: Any) -> list[tuple[bool, str, str]]:
    """(holds, field, detail) for the widths V4 and V4.1 share: RoPE inside the heads, the indexer's
    head at least the RoPE width, output groups dividing the heads, top-k within the experts."""
    return [
        (c.qk_rope_head_dim % 2 == 0 and c.qk_rope_head_dim <= c.head_dim, "qk_rope_head_dim",
         f"{c.qk_rope_head_dim} must be even and <= head_dim={c.head_dim}"),
        (c.index_head_dim >= c.qk_rope_head_dim, "index_head_dim",
         f"{c.index_head_dim} must be >= qk_rope_head_dim={c.qk_rope_head_dim}"),
        (c.num_attention_heads % c.o_groups == 0, "o_groups",
         f"{c.o_groups} must divide num_attention_heads={c.num_attention_heads}"),
        (c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
         f"{c.num_experts_per_tok} > n_routed_experts={c.n_routed_experts}"),
    ]


def raise_failed_checks(checks: list[tuple[bool, str, str]]) -> None:
    for ok, name, detail in checks:
        if not ok:
            raise ValueError(f"field `{name}`: {detail}")
