"""Conversations to prompt token ids.

The real DeepSeek-V4 / V4.1 checkpoints ship no Jinja template: their prompt format is DeepSeek's
own protocol library, `deepseek-recipe` (`DeepseekV4Encoding` / `DeepseekV41Encoding`), picked from
the checkpoint's `model_type`. A tokenizer that carries a chat template (test checkpoints) uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ChatFormatError", "encode_conversation"]

Message = dict[str, Any]


class ChatFormatError(ValueError):
    """A conversation cannot be rendered in the checkpoint's prompt format."""


def encode_conversation(
    messages: list[Message],
    *,
    tokenizer: Any,
    checkpoint_dir: Path,
    model_type: str,
    thinking_mode: bool,
    reasoning_effort: str | None,
) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    import deepseek_recipe as recipe

    encodings = {"deepseek_v4": recipe.DeepseekV4Encoding, "deepseek_v41": recipe.DeepseekV41Encoding}
    if model_type not in encodings:
        raise ChatFormatError(f"no DeepSeek prompt format for model_type {model_type!r}; expected one of "
                              f"{sorted(encodings)} or a tokenizer with a chat template")
    tokenizer_file = checkpoint_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ChatFormatError(f"{tokenizer_file} is missing: deepseek-recipe encodes prompts with it")
    conversation = recipe.Conversation(
        [_message(recipe, m, i) for i, m in enumerate(messages)],
        thinking_mode=thinking_mode,
        reasoning_effort=reasoning_effort,
    )
    encoding = encodings[model_type]().with_tokenizer(recipe.Tokenizer.from_file(str(tokenizer_file)))
    return list(encoding.encode(conversation))


def _message(recipe: Any, message: Message, index: int) -> Any:
    role, content = message.get("role"), message.get("content") or ""
    if not isinstance(content, str):
        raise ChatFormatError(f"messages[{index}].content must be a string, got {type(content).__name__}")
    if role == "system":
        return recipe.SystemMessage(content)
    if role == "user":
        return recipe.UserMessage(content)
    if role == "assistant":
        calls = [
            recipe.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        return recipe.AssistantMessage(content, message.get("reasoning_content"), calls or None)
    if role == "tool":
        return recipe.ToolMessage(content, message.get("tool_call_id"))
    raise ChatFormatError(
        f"messages[{index}].role is {role!r}; expected 'system', 'user', 'assistant' or 'tool'"
    )
