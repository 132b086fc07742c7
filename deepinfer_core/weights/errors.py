"""What can go wrong with a checkpoint; every message names the file, tensor or setting involved."""

__all__ = [
    "AlreadyQuantized",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "UnsafeCheckpointFormat",
]


class CheckpointError(Exception):
    """Base class for checkpoint problems."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint where one was looked for (local path, environment variable or hub id)."""


class UnsafeCheckpointFormat(CheckpointError):
    """A pickle-based file (`.bin`, `.pt`, `.pth`, `.ckpt`): loading it could run arbitrary code."""


class CorruptCheckpoint(CheckpointError):
    """A safetensors file or index that cannot be parsed, or whose data is truncated."""


class CheckpointMismatch(CheckpointError):
    """Checkpoint tensors and model disagree: a tensor missing, unexpected, or of the wrong shape or dtype."""


class AlreadyQuantized(CheckpointError):
    """A checkpoint given to the quantiser already stores quantised weights."""
