"""DeepInfer: inference for DeepSeek-V4-family MoE models on pluggable accelerator backends."""

__version__ = "0.1.0"

__all__ = ["__version__"]
