"""Errors of the platform layer: each says what was expected, what was found and what to do."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "DuplicateBackend",
    "GraphCaptureUnsupported",
    "InvalidBackendPlugin",
    "UnknownBackend",
]


class BackendError(RuntimeError):
    """Base class of every backend selection and registration error."""


class BackendUnavailable(BackendError):
    """A backend is installed but cannot run here (no device, missing driver or library...)."""


class UnknownBackend(BackendError):
    """No installed backend has the requested name."""


class DuplicateBackend(BackendError):
    """Two plugins registered a backend under the same name."""


class InvalidBackendPlugin(BackendError):
    """A `deepinfer.backends` entry point cannot be loaded or returned a malformed record."""


class CapabilityUnavailable(BackendError):
    """A feature was asked for that the selected backend's `capabilities()` does not claim."""


class GraphCaptureUnsupported(BackendError):
    """Graph capture was requested from a memory manager whose device has no graphs."""
