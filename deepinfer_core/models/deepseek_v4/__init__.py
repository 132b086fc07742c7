"""DeepSeek-V4 (`model_type: deepseek_v4`), exact against transformers' DeepseekV4ForCausalLM."""

from .cache import DeepseekV4Cache
from .model import DeepseekV4ForCausalLM, ModelOutput, MtpOutput

__all__ = ["DeepseekV4Cache", "DeepseekV4ForCausalLM", "ModelOutput", "MtpOutput"]
