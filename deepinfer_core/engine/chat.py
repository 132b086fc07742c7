"""Conversations to prompt token ids.

The real DeepSeek-V4 / V4.1 checkpoints ship no Jinja template: their prompt format is DeepSeek's
own protocol library, `deepseek-recipe` (`DeepseekV4Encoding` / `DeepseekV41Encoding`), picked from
the checkpoint's `model_type`. A tokenizer that carries a chat template (test checkpoints) uses it.

Images (DeepSeek-V4.1): a user message's content may be a list of OpenAI-style parts, `{"type": "text",
"text": ...}`, `{"type": "image_url", "image_url": {"url": <data: URL or local path>}}` or `{"type":
"image", "image": <PIL image, path, bytes or data: URL>}`. `split_images` turns each image part into the
tokenizer's image token (one per image, widened into the image's span later) and returns the images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ChatFormatError", "encode_conversation", "split_images"]

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
    image_token: str | None = None,
) -> list[int]:
    """Prompt token ids; `image_token` (the image placeholder's spelling) marks where images go in
    user messages, each occurrence encoding to the image token id."""
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
        [_message(recipe, m, i, image_token) for i, m in enumerate(messages)],
        thinking_mode=thinking_mode,
        reasoning_effort=reasoning_effort,
    )
    encoding = encodings[model_type]().with_tokenizer(recipe.Tokenizer.from_file(str(tokenizer_file)))
    if image_token is not None:
        encoding = encoding.with_special_tokens(recipe.SpecialTokens(image=image_token))
    return list(encoding.encode(conversation))


def split_images(messages: list[Message], image_token: str | None) -> tuple[list[Message], list[Any]]:
    """Messages with list contents flattened to strings (`image_token` where each image part was; nothing
    when the model has no image token) and the images in order."""
    flat, images = [], []
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            flat.append(message)
            continue
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(part.get("text") or "")
            elif kind in ("image_url", "image"):
                if message.get("role") != "user":
                    raise ChatFormatError(f"messages[{index}] is a {message.get('role')!r} message; images go in "
                                          "user messages")
                source = part.get(kind)
                images.append(source.get("url") if kind == "image_url" and isinstance(source, dict) else source)
                pieces.append(image_token or "")
            else:
                raise ChatFormatError(f"messages[{index}].content holds a part of type {kind!r}; expected 'text', "
                                      "'image_url' or 'image'")
        flat.append({**message, "content": "".join(pieces)})
    return flat, images


def _message(recipe: Any, message: Message, index: int, image_token: str | None = None) -> Any:
    role, content = message.get("role"), message.get("content") or ""
    if not isinstance(content, str):
        raise ChatFormatError(f"messages[{index}].content must be a string, got {type(content).__name__}")
    if role == "system":
        return recipe.SystemMessage(content)
    if role == "user":
        count = content.count(image_token) if image_token else 0
        if count:  # placeholders only: the images themselves travel beside the prompt
            return recipe.UserMessage(content, [recipe.BytesImageSource(b"")] * count, image_token=image_token)
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
