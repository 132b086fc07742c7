"""A deepseek-recipe conversation to prompt token ids.

Real DeepSeek-V4 / V4.1 checkpoints are encoded by deepseek-recipe's own encoding (tools, thinking
mode and response format included). A checkpoint whose tokenizer carries a chat template (the
tiny test checkpoint) is rendered with that template; such a template knows no thinking mode, so
its outputs are parsed as plain answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepseek_recipe as recipe

from deepinfer_core.engine.chat import encode_conversation

__all__ = ["ConversationEncoder", "model_version_for"]

_VERSIONS = {"deepseek_v4": recipe.ModelVersion.DeepseekV4Pro, "deepseek_v41": recipe.ModelVersion.DeepseekV41Flash}


def model_version_for(model_type: str) -> recipe.ModelVersion:
    if model_type not in _VERSIONS:
        raise ValueError(f"no deepseek-recipe model version for model_type {model_type!r}; "
                         f"expected one of {sorted(_VERSIONS)}")
    return _VERSIONS[model_type]


class ConversationEncoder:
    def __init__(self, tokenizer: Any, checkpoint_dir: Path, model_type: str) -> None:
        self.tokenizer = tokenizer
        self.checkpoint_dir = checkpoint_dir
        self.model_type = model_type
        self.uses_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.recipe_tokenizer = recipe.Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
        encoding = (recipe.DeepseekV41Encoding if model_type == "deepseek_v41" else recipe.DeepseekV4Encoding)()
        self._encoding = encoding.with_tokenizer(self.recipe_tokenizer)

    def encode(self, conversation: recipe.Conversation) -> list[int]:
        """Raises ValueError (ChatFormatError) or RuntimeError for a conversation it cannot encode."""
        if self.uses_chat_template:
            return encode_conversation(
                [_as_dict(m) for m in conversation.messages], tokenizer=self.tokenizer,
                checkpoint_dir=self.checkpoint_dir, model_type=self.model_type,
                thinking_mode=False, reasoning_effort=None,
            )
        return list(self._encoding.encode(conversation))

    def parsing_options(self, options: recipe.ParsingOptions) -> recipe.ParsingOptions:
        """The request's parsing options, adjusted to how its prompt was rendered."""
        if self.uses_chat_template:
            options.thinking_initial_stage = None
        return options


def _as_dict(message: recipe.Message) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning_content is not None:
        entry["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry
