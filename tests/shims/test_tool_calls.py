"""`tool_calls`: the JSON an answer holds found without MAX's backtracking pattern, and
the conformance check of an answer against a schema with a regular expression left
alone."""

from __future__ import annotations

import pytest
from max.serve import _tool_call_validation
from max.serve.parser import json_utils, llama_tool_parser
from max.serve.router import openai_routes

from gpt2_max.shims import tool_calls

pytestmark = pytest.mark.tier("unit")

TEXTS = [
    'hello {"a": [1, 2, {"b": null}]} and [true, false] 12 -3.5e2 untrue',
    '{"name": "f", "parameters": {"x": 1}}; {"name": "g"}',
    "[1, 2", '"abc', "[1,]", '{"a":1}{"b":2}', "01 1. -x NaN Infinity -Infinity nulll",
    '  -0.0e+5, [] {} ""', "1e5 1E+2 2e", "no json here",
]


@pytest.mark.parametrize("text", TEXTS)
def test_the_values_are_maxs(text):
    assert tool_calls.json_values(text) == json_utils.parse_json_from_text(text)


def test_escaped_characters_in_strings_are_read():
    """MAX's pattern takes an escape only as two backslashes: the call came apart."""
    call = '{"name": "f", "arguments": {"text": "say \\"hi\\"\\nthen go"}}'
    assert tool_calls.json_values(call) == [
        {"name": "f", "arguments": {"text": 'say "hi"\nthen go'}}]
    assert json_utils.parse_json_from_text(call) != tool_calls.json_values(call)


@pytest.mark.parametrize("text", ['"' + "[ " * 2000, "[ 1, " * 2000, "{" * 5000])
def test_text_left_open_ends(text):
    """MAX's pattern doubles its time with each level of `"[ [ [` (2 s at 15 levels);
    this reads 2,000, and nesting past Python's recursion limit."""
    values = tool_calls.json_values(text)
    assert values == ([1] * 2000 if "1" in text else [])


REDOS = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}}


def test_the_conformance_check_leaves_a_schema_with_a_pattern_unchecked():
    """jsonschema runs the client's `pattern` through Python's `re`: against forty `a`
    and a `!` it never ended, on the API's event loop."""
    tool_calls.install()
    answer = '{"x": "' + "a" * 40 + '!"}'
    result = _tool_call_validation.check_response_format_conformance(answer, REDOS)
    assert result.outcome == "valid"
    (call,) = _tool_call_validation.check_tool_call_conformance(
        [("f", answer)], {"f": REDOS})
    assert call.outcome == "valid"
    plain = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert _tool_call_validation.check_response_format_conformance(
        answer, plain).outcome == "schema_mismatch"  # the others are still checked


def test_install_puts_the_finder_where_maxs_parsers_call_it():
    tool_calls.install()
    built = _tool_call_validation._build_validator
    tool_calls.install()
    assert _tool_call_validation._build_validator is built and built.bounded
    assert llama_tool_parser.parse_json_from_text is tool_calls.json_values
    assert openai_routes.parse_json_from_text is tool_calls.json_values


def doubling_refs(levels: int, dialect: str | None = None) -> dict:
    """`levels` definitions, each `allOf` two refs to the next: jsonschema walks the last
    one 2**levels times for one answer. Each names `dialect` as its `$schema`, if given."""
    named = {"$schema": dialect} if dialect else {}
    defs = {f"d{i}": {**named, "allOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}
            for i in range(levels)}
    defs[f"d{levels}"] = {"type": "object", "required": ["a"], "additionalProperties": False,
                          "properties": {"a": {"type": "boolean"}}}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("dialect", [
    None, "http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2020-12/schema",
])
def test_the_conformance_check_stops_after_its_steps(monkeypatch, dialect):
    """Thirty doubling refs in 1.5 KB held MAX's check for hours on the API's event loop:
    it stops after `CHECK_STEPS` keyword checks and counts the answer as conforming,
    and a check within them still finds a mismatch. A subschema's `$schema` made
    `jsonschema` switch to a validator that was not counted."""
    tool_calls.install()
    steps = 0
    counted = tool_calls._counted

    def counting(check):
        inner = counted(check)

        def step(*args):
            nonlocal steps
            steps += 1
            return inner(*args)

        return step

    monkeypatch.setattr(tool_calls, "_counted", counting)
    tool_calls._counting_validator.cache_clear()
    tool_calls._within_steps.cache_clear()
    try:
        for answer in ('{"a": true}', '{"a": 1}'):
            result = _tool_call_validation.check_response_format_conformance(
                answer, doubling_refs(30, dialect))
            assert result.outcome == "valid"
            (call,) = _tool_call_validation.check_tool_call_conformance(
                [("f", answer)], {"f": doubling_refs(30, dialect)})
            assert call.outcome == "valid"
        assert steps <= 4 * (tool_calls.CHECK_STEPS + 1)
        assert _tool_call_validation.check_response_format_conformance(
            '{"a": 1}', doubling_refs(4, dialect)).outcome == "schema_mismatch"
    finally:
        tool_calls._counting_validator.cache_clear()
        tool_calls._within_steps.cache_clear()
