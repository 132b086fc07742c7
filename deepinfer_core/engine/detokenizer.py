"""Incremental detokenisation and stop-string matching on the text produced so far.

Decoding a growing id list one token at a time is wrong for byte-level BPE (a character can span
tokens, and spaces depend on neighbours), so each step decodes a short window that starts a few
tokens back and emits only the text past what that window already produced; an unfinished
character (U+FFFD at the end) waits for the next token.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "text", "stop", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.text = ""
        self.stop = stop
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; return the stop string it completed, else None.

        On a stop string, `text` is cut just before it (the stop string is not part of the output).
        """
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return None
        searched_from = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._cut_at_stop(searched_from)

    def _cut_at_stop(self, start: int) -> str | None:
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[:at]
        return stop

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
