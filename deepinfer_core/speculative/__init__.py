"""Speculative decoding: a drafter proposes tokens, the target verifies them in one step."""

from .config import SpeculativeConfig
from .drafter import Draft, DraftContext, Drafter, confident_prefix
from .mtp_drafter import MtpDrafter, MtpUnavailable
from .stats import SpeculativeStats
from .target_step import prefill_context, verify_step
from .verifier import Verification, verify

__all__ = [
    "Draft",
    "DraftContext",
    "Drafter",
    "MtpDrafter",
    "MtpUnavailable",
    "SpeculativeConfig",
    "SpeculativeStats",
    "Verification",
    "confident_prefix",
    "prefill_context",
    "verify",
    "verify_step",
]
