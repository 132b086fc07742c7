"""A template third-party DeepInfer backend named `example` (host device, one op overridden)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
