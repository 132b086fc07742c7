"""Errors of the parallel layer: each says what was expected, what was found and what to do."""

from __future__ import annotations

__all__ = ["LaunchTimeout", "ParallelConfigError", "PlacementError", "RankFailed"]


class ParallelConfigError(ValueError):
    """The requested ep / dp sizes do not fit the number of ranks or the model's experts."""


class PlacementError(ValueError):
    """An expert placement is malformed (an expert with no slot, one rank holding an expert twice...)."""


class RankFailed(RuntimeError):
    """A rank of a multi-process run raised or exited; the others were stopped."""


class LaunchTimeout(RuntimeError):
    """A multi-process run did not finish within its time limit; every rank was stopped."""
