"""Speculative decoding: a drafter proposes tokens, the target verifies them in one step."""

from .budget import survival_budget
from .config import SpeculativeConfig
from .drafter import Draft, DraftContext, Drafter, confident_prefix
from .dspark_drafter import DSparkDrafter
from .mtp_drafter import MtpDrafter, MtpUnavailable
from .stats import SpeculativeStats
from .target_step import prefill_context, verify_step
from .verifier import Verification, verify

__all__ = [
    "Draft",
    "DraftContext",
    "DSparkDrafter",
    "Drafter",
    "MtpDrafter",
    "MtpUnavailable",
    "SpeculativeConfig",
    "SpeculativeStats",
    "Verification",
    "confident_prefix",
    "prefill_context",
    "survival_budget",
    "verify",
    "verify_step",
]
