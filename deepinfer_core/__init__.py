"""DeepInfer: inference for DeepSeek-V4-family MoE models on pluggable accelerator backends."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutput",
    "__version__",
]

# NOTE: resolved on first use so `import deepinfer_core` stays cheap (no torch until needed).
_LAZY = {
    "LLM": "deepinfer_core.engine.llm",
    "InvalidRequestError": "deepinfer_core.engine.llm",
    "CompletionOutput": "deepinfer_core.engine.outputs",
    "RequestOutput": "deepinfer_core.engine.outputs",
    "SamplingParams": "deepinfer_core.engine.sampling_params",
    "EngineConfig": "deepinfer_core.config",
    "SchedulerConfig": "deepinfer_core.config",
    "SpeculativeConfig": "deepinfer_core.speculative.config",
    "StructuredOutput": "deepinfer_core.engine.structured",
}

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig, SchedulerConfig
    from deepinfer_core.engine.llm import LLM, InvalidRequestError
    from deepinfer_core.engine.outputs import CompletionOutput, RequestOutput
    from deepinfer_core.engine.sampling_params import SamplingParams
    from deepinfer_core.engine.structured import StructuredOutput
    from deepinfer_core.speculative.config import SpeculativeConfig


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
