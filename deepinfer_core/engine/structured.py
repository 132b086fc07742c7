"""Structured output as the user asks for it: a regex, a JSON schema, an EBNF grammar or any JSON
object, validated here; compiled and matched in grammar.py, masked in grammar_bitmask.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["GrammarKind", "InvalidGrammarError", "StructuredOutput"]

GrammarKind = Literal["regex", "json_schema", "ebnf", "json_object"]
_KINDS: tuple[GrammarKind, ...] = ("regex", "json_schema", "ebnf", "json_object")


class InvalidGrammarError(ValueError):
    """A structured-output constraint that cannot be compiled; `kind` names which one it was."""

    def __init__(self, kind: GrammarKind, detail: str) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"invalid {kind} for structured output: {detail}")


class StructuredOutput(BaseModel):
    """Constrain a request's output to exactly one of: `regex` (the whole output full-matches it),
    `json_schema` (a dict or a JSON string; the output is one JSON value valid against it, with no
    properties beyond those the schema names), `ebnf` (xgrammar's EBNF dialect, start rule `root`),
    `json_object=True` (any JSON object)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    ebnf: str | None = None
    json_object: bool = False

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> StructuredOutput:
        chosen = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            found = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                "StructuredOutput takes exactly one of regex, json_schema, ebnf, json_object=True; "
                f"found {found}"
            )
        return self

    @property
    def kind(self) -> GrammarKind:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[GrammarKind, str]:
        """(kind, spec) with a JSON schema re-serialised compactly, so spellings of one schema
        share a compiled grammar. Raises `InvalidGrammarError` for a schema string that is not JSON."""
        kind = self.kind
        if kind == "regex":
            return kind, self.regex
        if kind == "ebnf":
            return kind, self.ebnf
        if kind == "json_object":
            return kind, ""
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise InvalidGrammarError(kind, f"the schema string is not JSON: {error}") from None
        # NOTE: keys keep their order: property order is the order the grammar makes the output use.
        return kind, json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
