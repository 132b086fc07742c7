"""Triton kernels that accelerate DeepInfer's `KernelOps` (used by the nvidia backend).

Kernels are device code only; which op uses which kernel is decided by the backend that imports
them. Under CI they run through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
