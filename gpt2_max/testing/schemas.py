"""JSON schemas for tests of a structured-output path, with what a correct answer must respect."""

from __future__ import annotations

from gpt2_max.json_schemas import NUMBER_CHARS

UNBOUNDED_NUMBERS = {
    "type": "object",
    "properties": {"price": {"type": "number", "minimum": 0}, "ratio": {"type": "number"},
                   "counts": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["price", "ratio", "counts"],
    "additionalProperties": False,
}
"""Numbers with no digit limit of their own: only `gpt2_max.json_schemas`' rule closes them."""

UNBOUNDED_NUMBERS_LONGEST = len('{"price":,"ratio":,"counts":[,,]}') + 5 * NUMBER_CHARS
"""The longest compact answer to `UNBOUNDED_NUMBERS` under the number rule, in characters,
so also in GPT-2 tokens (each is at least one character of ASCII text)."""

SHORT = {"type": "string", "maxLength": 8}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested-optional": {
        "type": "object",
        "properties": {
            "name": SHORT,
            "address": {
                "type": "object",
                "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "nickname": SHORT,
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array-min-max": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 4},
    "enum": {"enum": ["red", "grün", "blue", 3, None]},
    "any-of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, SHORT,
                         {"type": "boolean"}]},
    "defs-ref": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "day": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["code", "day"],
        "additionalProperties": False,
    },
    "prefix-items": {"type": "array", "prefixItems": [SHORT, {"type": "boolean"}],
                     "minItems": 2, "maxItems": 2},
    "const-nullable": {
        "type": "object",
        "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                        "maximum": 9},
                       "label": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["kind", "r", "label"],
        "additionalProperties": False,
    },
    "numbers": UNBOUNDED_NUMBERS,
}
"""Nine schemas of the kinds clients send (nested objects with optional properties, arrays
with min/max items, enums with non-ASCII and non-string members, `anyOf`, `$defs`/`$ref`,
patterns, `prefixItems`, `const` and nullable, unbounded numbers), each with a finite
answer: the serving tests and `benchmarks/bench_structured.py` run them."""
