"""DeepSeek-V4.1 (`deepseek_v41`), text path (MODEL_SPEC_V41)."""

from .cache import DeepseekV41Cache
from .config import DeepseekV41Config, DeepseekV41TextConfig, parse_deepseek_v41_config
from .model import DeepseekV41ForCausalLM, ModelOutput

__all__ = [
    "DeepseekV41Cache",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV41TextConfig",
    "ModelOutput",
    "parse_deepseek_v41_config",
]
