"""Model class for a typed model config (dispatch on the config's model type, never the name)."""

from __future__ import annotations

from deepinfer_core.model_config import DeepseekV4Config, ModelConfig, UnsupportedModelError

__all__ = ["UnsupportedKvCacheDtypeError", "cache_class_for", "kv_cache_options", "model_class_for"]


class UnsupportedKvCacheDtypeError(ValueError):
    """The engine's kv_cache_dtype names a KV format this model's cache cannot store."""


def model_class_for(config: ModelConfig) -> type:
    if isinstance(config, DeepseekV4Config):
        from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config

    if isinstance(config, DeepseekV41Config):
        from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM
    raise UnsupportedModelError(f"no model class for config type {type(config).__name__}")


def cache_class_for(config: ModelConfig) -> type:
    """The paged decode-state class that `model_class_for(config)` reads and writes."""
    if isinstance(config, DeepseekV4Config):
        from deepinfer_core.models.deepseek_v4 import DeepseekV4Cache

        return DeepseekV4Cache
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config

    if isinstance(config, DeepseekV41Config):
        from deepinfer_core.models.deepseek_v41 import DeepseekV41Cache

        return DeepseekV41Cache
    raise UnsupportedModelError(f"no cache class for config type {type(config).__name__}")


def kv_cache_options(config: ModelConfig, kv_cache_dtype: str) -> dict[str, str]:
    """Keyword arguments that give the model, its cache class and the cache's byte counts the KV
    format `kv_cache_dtype` ("auto": the model's own format; "bf16": the model dtype, unquantised;
    "fp8_fp4": V4.1's fp8 window / fp4 compressed formats)."""
    if isinstance(config, DeepseekV4Config):
        if kv_cache_dtype not in ("auto", "bf16"):
            raise UnsupportedKvCacheDtypeError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported by {config.model_type}: its cache stores "
                "the model dtype; use kv_cache_dtype='auto' (or 'bf16')"
            )
        return {}
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.models.deepseek_v41.kv_quant import KV_CACHE_DTYPES

    if isinstance(config, DeepseekV41Config):
        if kv_cache_dtype == "auto":
            return {"kv_cache_dtype": KV_CACHE_DTYPES[0]}
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UnsupportedKvCacheDtypeError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported by {config.model_type}; expected 'auto' "
                f"or one of {KV_CACHE_DTYPES}"
            )
        return {"kv_cache_dtype": kv_cache_dtype}
    raise UnsupportedModelError(f"no KV cache for config type {type(config).__name__}")
