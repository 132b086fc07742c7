"""Helpers of the tests/test_server_*.py files: the server on the tiny checkpoint, on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server tests need the `serve` extra")
pytest.importorskip("httpx", reason="the server tests need the `dev` extra")

from deepinfer_core import LLM
from deepinfer_core.server.limits import ServerLimits
from deepinfer_core.server.serve import BackgroundServer

MODEL = "tiny"
# Greedy answers without reasoning (thinking forces temperature 1 in deepseek-recipe).
GREEDY_CHAT = {"temperature": 0, "thinking": {"type": "disabled"}}


@contextmanager
def running_server(checkpoint: Path, *, num_kv_blocks: int = 256, max_num_seqs: int = 64,
                   limits: ServerLimits | None = None) -> Iterator[BackgroundServer]:
    llm = LLM(str(checkpoint), accelerator="cpu", num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=1024)
    limits = limits or ServerLimits(max_tokens=64, max_request_bytes=64 * 1024)
    with BackgroundServer(llm, model_name=MODEL, limits=limits) as server:
        yield server


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} is not in the metrics")


def make_recipe_checkpoint(path: Path) -> Path:
    """The tiny checkpoint with DeepSeek's special tokens in its tokenizer and no chat template, so
    prompts are rendered by deepseek-recipe's V4 encoding (thinking, tools) as on real checkpoints."""
    import json as json_lib
    import textwrap

    import deepseek_recipe as recipe
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from deepinfer_core.tools import make_tiny_checkpoint
    from deepinfer_core.tools.tiny_checkpoint import BOS_TOKEN, EOS_TOKEN

    vocab_size = 544
    make_tiny_checkpoint(path, overrides={"vocab_size": vocab_size})
    specials = [BOS_TOKEN, EOS_TOKEN] + [
        token.default_str() for token in (getattr(recipe.SpecialToken, name) for name in (
            "ThinkingStart", "ThinkingEnd", "System", "User", "Assistant", "LatestReminder", "Dsml", "Image"))
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([Path(json_lib.__file__).read_text(), Path(textwrap.__file__).read_text()],
                                  trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json_lib.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "add_bos_token": False,
    }))
    return path
