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
