"""Huawei Ascend NPU backend of DeepInfer: selected with DEEPINFER_ACCELERATOR=ascend."""

__version__ = "0.1.0"

__all__ = ["__version__"]
