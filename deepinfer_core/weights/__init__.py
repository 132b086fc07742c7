"""Checkpoint resolution, naming, safetensors streaming, loading and quantisation of DeepSeek-V4 weights."""

from deepinfer_core.weights.errors import (
    CheckpointError,
    CheckpointMismatch,
    CheckpointNotFound,
    CorruptCheckpoint,
    UnsafeCheckpointFormat,
)
from deepinfer_core.weights.loader import ExpertFilter, load_model_weights
from deepinfer_core.weights.resolve import DEFAULT_MODEL_ID, resolve_model_path

__all__ = [
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "DEFAULT_MODEL_ID",
    "ExpertFilter",
    "UnsafeCheckpointFormat",
    "load_model_weights",
    "resolve_model_path",
]
