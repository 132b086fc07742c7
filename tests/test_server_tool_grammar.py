"""The DSML tool-call grammar: it admits exactly the calls whose arguments fit the declared schemas,
and what it admits, deepseek-recipe parses into arguments that validate."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from deepinfer_core.server.tool_call_grammar import tool_call_ebnf

jsonschema = pytest.importorskip("jsonschema", reason="arguments are checked with the jsonschema library")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}, "units": {"type": "string", "enum": ["c", "f"]},
    "precise": {"type": "boolean"}, "where": {"type": "object"}, "ratio": {"type": "number"},
}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def _param(name: str, value: str, string: bool) -> str:
    return f'<｜DSML｜parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>\n'


def _call(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "".join(params) + "</｜DSML｜invoke>\n"


END = "</｜DSML｜tool_calls>"
GOOD = [
    _call("get_weather", _param("city", "Paris", True), _param("days", "3", False)) + END,
    _call("get_weather", _param("city", "New York, NY", True), _param("days", "-2", False),
          _param("units", "f", True), _param("precise", "true", False), _param("where", '{"lat": 1.5}', False),
          _param("ratio", "0.25e3", False)) + END,
    _call("now") + _call("get_weather", _param("city", "", True), _param("days", "0", False)) + END,
]
BAD = [
    _call("get_weather", _param("city", "Paris", True)) + END,                                # days missing
    _call("get_weather", _param("city", "Paris", True), _param("days", "three", False)) + END,  # not an integer
    _call("get_weather", _param("city", "Pa<ris", True), _param("days", "3", False)) + END,   # '<' in a string
    _call("get_weather", _param("city", "Paris", True), _param("days", "3", False),
          _param("units", "kelvin", True)) + END,                                              # not in the enum
    _call("get_weather", _param("days", "3", False), _param("city", "Paris", True)) + END,    # out of order
    _call("delete_everything") + END,                                                          # undeclared tool
    _call("now"),                                                                              # block never ends
    _call("get_weather", _param("city", "Llanfairpwllgwyngyll", True), _param("days", "1", False)) + END,  # too long
    _call("now") * 9 + END,                                                                    # over the call limit
    END,                                                                                       # no call at all
]


@pytest.fixture(scope="module")
def grammar() -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(tool_call_ebnf(TOOLS))


@pytest.mark.parametrize("text", GOOD)
def test_grammar_admits_calls_that_fit_and_recipe_parses_them(grammar, text):
    assert _is_grammar_accept_string(grammar, text)
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "tool_choice": "required", "thinking": {"type": "disabled"}}
    options = recipe.ConversionOptions().with_model_versions_by_name({"m": recipe.ModelVersion.DeepseekV4Pro})
    converted = recipe.ChatCompletionRequest(body).convert(options)
    assert converted.inference_options.output_constraint.kind == "tool_call_required"
    processor = recipe.StreamProcessor(recipe.ChatCompletionRequest.chunk_generator(converted, "c", "m"),
                                       converted.parsing_options)
    response = recipe.ChatCompletionResponse("c", "m", 0, 1, 0)
    chunks = processor.push(recipe.InferenceChunk.ready())
    chunks += processor.push(recipe.InferenceChunk.text(text, 1))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    for chunk in chunks + processor.finish():
        response.accumulate(chunk)
    message = json.loads(response.to_json())["choices"][0]["message"]
    assert not message["content"]  # no DSML leaks into the answer text
    calls = message["tool_calls"]
    assert len(calls) == text.count("invoke name=")
    for call in calls:
        if call["function"]["name"] == "get_weather":
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


@pytest.mark.parametrize("text", BAD)
def test_grammar_refuses_calls_that_do_not_fit(grammar, text):
    assert not _is_grammar_accept_string(grammar, text)
