"""Developer tools shipped with the core (tiny random checkpoints for demos and tests)."""

from .tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint
from .tiny_v41_checkpoint import make_tiny_v41_checkpoint

__all__ = ["TINY_CONFIG", "make_tiny_checkpoint", "make_tiny_v41_checkpoint"]
