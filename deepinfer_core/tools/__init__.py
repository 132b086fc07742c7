"""Developer tools shipped with the core (tiny random checkpoints for demos and tests)."""

from .tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint

__all__ = ["TINY_CONFIG", "make_tiny_checkpoint"]
