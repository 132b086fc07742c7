"""Every `DEEPINFER_*` environment variable, parsed here and nowhere else.

Each variable is read when its function is called (not at import), so a test or a launcher can set
it late. `ENV_VARS` lists them all for `deepinfer backends` and the README's configuration table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_VARS",
    "EnvVar",
    "InvalidEnvVar",
    "accelerator",
    "batch_invariant",
    "hf_model_dir",
    "pdl",
]


class InvalidEnvVar(ValueError):
    """An environment variable holds a value DeepInfer cannot parse."""


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str
    doc: str


ACCELERATOR = EnvVar(
    "DEEPINFER_ACCELERATOR",
    "auto",
    "Backend to run on: `cpu`, `nvidia`, `ascend`, any installed third-party backend name, or "
    "`auto` (the available backend with the highest priority). A named backend that is missing "
    "or unavailable is an error, never a silent fallback.",
)
HF_MODEL_DIR = EnvVar(
    "DEEPINFER_HF_MODEL_DIR",
    "",
    "Checkpoint directory (config.json + *.safetensors) used when no model is named explicitly; "
    "an explicit model path or hub id wins over it, and without either the default hub id is "
    "downloaded into the Hugging Face cache.",
)
BATCH_INVARIANT = EnvVar(
    "DEEPINFER_BATCH_INVARIANT",
    "0",
    "`1` turns on batch-invariant mode: one request's logits are bitwise the same alone or in "
    "any batch. The backend must report the `batch_invariant` capability.",
)

PDL = EnvVar(
    "DEEPINFER_PDL",
    "1",
    "`0` turns off programmatic dependent launch of the Triton kernels (on sm_90 and newer a kernel is "
    "launched while the one before it drains), to measure what it saves.",
)

ENV_VARS: tuple[EnvVar, ...] = (ACCELERATOR, HF_MODEL_DIR, BATCH_INVARIANT, PDL)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _raw(var: EnvVar) -> str:
    return os.environ.get(var.name, var.default).strip()


def _flag(var: EnvVar) -> bool:
    value = _raw(var).lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidEnvVar(
        f"{var.name}={os.environ[var.name]!r} is not a boolean: use one of "
        f"{sorted(_TRUE)} or {sorted(_FALSE - {''})}"
    )


def accelerator() -> str:
    """The requested backend name, lower-cased; `auto` when unset or empty."""
    return _raw(ACCELERATOR).lower() or "auto"


def hf_model_dir() -> Path | None:
    """The local checkpoint directory, or None when unset."""
    value = _raw(HF_MODEL_DIR)
    return Path(value).expanduser() if value else None


def batch_invariant() -> bool:
    """Whether batch-invariant mode is requested."""
    return _flag(BATCH_INVARIANT)


def pdl() -> bool:
    """Whether the Triton kernels may use programmatic dependent launch."""
    return _flag(PDL)
