"""A grammar (xgrammar EBNF) for DeepSeek's DSML tool-call block, built from the request's tools, so
that a required tool call names a declared tool and passes each parameter the type its schema
declares: required parameters always, optional ones at most once, in the schema's order.

String parameters are written as is (`string="true"`, no `<`, so the closing tag cannot be
faked, within the schema's minLength / maxLength); integers, numbers, booleans and enums as their
JSON literals; nested objects and arrays as any JSON value (their inner schema is not enforced).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["tool_call_ebnf"]

_DSML = "<｜DSML｜"
# NOTE: a block holds at most this many calls, so a model that never closes it still ends.
_MAX_CALLS = 8
_JSON_RULES = r"""
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ws (json_string ws ":" ws json_value (ws "," ws json_string ws ":" ws json_value)*)? ws "}"
json_array ::= "[" ws (json_value (ws "," ws json_value)*)? ws "]"
json_string ::= "\"" ([^"\\<\x00-\x1f] | "\\" ["\\/bfnrt])* "\""
json_integer ::= "-"? ("0" | [1-9] [0-9]{0,17})
json_number ::= json_integer ("." [0-9]{1,17})? ([eE] [+-]? [0-9]{1,3})?
ws ::= [ \n]{0,2}
raw_text ::= [^<]*
"""


def tool_call_ebnf(tools: list[dict[str, Any]]) -> str:
    """EBNF for what follows the opened tool-call block: one or more invocations, then its end.

    `tools` are Chat Completions function tools (deepseek-recipe's `tool_call_required` constraint)."""
    rules = []
    invokes = []
    for index, tool in enumerate(tools):
        function = tool.get("function", tool)
        name = function["name"]
        schema = function.get("parameters") or {}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        parts = []
        for number, (param, param_schema) in enumerate(properties.items()):
            rule = f"tool{index}_param{number}"
            rules.append(f"{rule} ::= {_parameter(param, param_schema if isinstance(param_schema, dict) else {})}")
            parts.append(rule if param in required else f"{rule}?")
        invoke = f"tool{index}"
        opening = _literal(f'{_DSML}invoke name="{name}">\n')
        closing = _literal("</｜DSML｜invoke>\n")
        rules.append(f"{invoke} ::= {opening} {' '.join(parts)} {closing}")
        invokes.append(invoke)
    root = f"root ::= ({' | '.join(invokes)}){{1,{_MAX_CALLS}}} {_literal('</｜DSML｜tool_calls>')}"
    return "\n".join([root, *rules]) + _JSON_RULES


def _parameter(name: str, schema: dict[str, Any]) -> str:
    closing = _literal("</｜DSML｜parameter>\n")
    is_string = schema.get("type") == "string"
    opening = _literal(f'{_DSML}parameter name="{name}" string="{"true" if is_string else "false"}">')
    return f"{opening} {_value(schema, is_string)} {closing}"


def _value(schema: dict[str, Any], is_string: bool) -> str:
    if "enum" in schema:
        choices = [str(v) if is_string else json.dumps(v) for v in schema["enum"]]
        return "(" + " | ".join(_literal(c) for c in choices) + ")"
    kind = schema.get("type")
    if is_string:
        if "minLength" in schema or "maxLength" in schema:
            most = str(int(schema["maxLength"])) if "maxLength" in schema else ""
            return f"[^<]{{{int(schema.get('minLength', 0))},{most}}}"
        return "raw_text"
    return {"integer": "json_integer", "number": "json_number", "boolean": '("true" | "false")',
            "null": '"null"', "object": "json_object", "array": "json_array"}.get(kind, "json_value")


def _literal(text: str) -> str:
    # A JSON string literal is also an xgrammar EBNF string literal.
    return json.dumps(text, ensure_ascii=False)
