"""Where the checkpoint lives: an explicit path or hub id, else `DEEPINFER_HF_MODEL_DIR`, else the default id.

Hub ids are fetched with `huggingface_hub.snapshot_download` into the Hugging Face cache (only
safetensors, json and tokenizer files), so a second run finds them there without the network.
"""

import re
from os import PathLike
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, HTTPError

from deepinfer_core import envs
from deepinfer_core.weights.errors import CheckpointNotFound

__all__ = ["DEFAULT_MODEL_ID", "HUB_FILE_PATTERNS", "resolve_model_path"]

DEFAULT_MODEL_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
HUB_FILE_PATTERNS = (
    "*.safetensors",
    "*.json",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.txt",
    "merges.txt",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_model_path(model: str | PathLike | None = None) -> Path:
    """The local checkpoint directory for `model` (a directory or a hub id `owner/name`).

    `model` wins over `DEEPINFER_HF_MODEL_DIR`, which wins over DEFAULT_MODEL_ID. Raises
    CheckpointNotFound naming what was looked for when the directory is missing or the download fails.
    """
    if model is not None and str(model):
        return _local_or_hub(str(model), origin="the model argument")
    env_dir = envs.hf_model_dir()
    if env_dir is not None:
        return _existing_dir(env_dir, origin=f"{envs.HF_MODEL_DIR.name}={env_dir}")
    return _download(DEFAULT_MODEL_ID, origin="the default model")


def _local_or_hub(model: str, origin: str) -> Path:
    path = Path(model).expanduser()
    if path.exists() or not _HUB_ID.match(model):
        return _existing_dir(path, origin=f"{origin} {model!r}")
    return _download(model, origin=f"{origin} {model!r}")


def _existing_dir(path: Path, origin: str) -> Path:
    if not path.is_dir():
        raise CheckpointNotFound(
            f"checkpoint directory {path} (from {origin}) does not exist or is not a directory; pass a directory "
            "holding config.json and *.safetensors, or a hub id such as 'owner/name'"
        )
    return path


def _download(repo_id: str, origin: str) -> Path:
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILE_PATTERNS)))
    except (OSError, HTTPError, HFValidationError) as err:
        raise CheckpointNotFound(
            f"could not get hub model {repo_id!r} (from {origin}) into the Hugging Face cache: {err}. "
            f"When offline, download it beforehand, or point {envs.HF_MODEL_DIR.name} or the model argument at a "
            "local checkpoint directory."
        ) from err
