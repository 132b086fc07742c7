"""Model class for a typed model config (dispatch on the config's model type, never the name)."""

from __future__ import annotations

from deepinfer_core.model_config import DeepseekV4Config, ModelConfig, UnsupportedModelError

__all__ = ["cache_class_for", "model_class_for"]


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
