"""NVIDIA GPU backend of DeepInfer: selected with DEEPINFER_ACCELERATOR=nvidia."""

__version__ = "0.1.0"

__all__ = ["__version__"]
