"""`gpt2_max.json_schemas`: schemas with no finite value are named, numbers are bounded alike
in llguidance (the generator's engine) and xgrammar (MAX's, as `max serve` builds it)."""

from __future__ import annotations

import random

import pytest
from llguidance import LLMatcher
from max.pipelines.lib.pipeline_variants.structured_output_backend import make_grammar_backend
from transformers import AutoTokenizer

from gpt2_max import json_schemas
from gpt2_max.generate.constrained import compile_constraint, llg_tokenizer
from gpt2_max.json_schemas import (
    FRACTION_DIGITS,
    INTEGER_DIGITS,
    MAX_DEPTH,
    MAX_NUMBERS,
    SchemaError,
    bound_numbers,
    infinite_cycle,
    loaded,
    prepare,
)
from gpt2_max.tokenizer import TOKENIZER_DIR

pytestmark = pytest.mark.tier("unit")

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}


@pytest.mark.parametrize(
    "schema, cycle",
    [
        ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
         "#/$defs/node (via property 'next') -> #/$defs/node"),
        ({"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
         "# (via property 'self') -> #"),
        ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                          "required": ["b"]},
                    "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
          "type": "object", "properties": {"top": {"$ref": "#/$defs/a"}}, "required": ["top"]},
         "#/$defs/a (via property 'b') -> #/$defs/b (via item 0) -> #/$defs/a"),
        # An object or an array: the array's required item has no value (`false`).
        ({"$defs": {"n": {"type": ["object", "array"], "properties": {"k": {"$ref": "#/$defs/n"}},
                          "required": ["k"], "items": False, "minItems": 1}},
          "$ref": "#/$defs/n"},
         "#/$defs/n (via property 'k') -> #/$defs/n"),
    ],
)
def test_a_required_cycle_is_named(schema, cycle) -> None:
    assert infinite_cycle(schema) == cycle
    with pytest.raises(SchemaError, match="no finite value"):
        prepare(schema, multiple_of=False)


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"node": {**NODE, "required": []}}, "$ref": "#/$defs/node"},
        {"$defs": {"node": {**NODE, "properties": {"next": {
            "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}}, "$ref": "#/$defs/node"},
        {"$defs": {"node": {**NODE, "type": ["object", "string"]}}, "$ref": "#/$defs/node"},
        {"$defs": {"tree": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
         "$ref": "#/$defs/tree"},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    ],
)
def test_recursive_schemas_with_a_way_out_pass(schema) -> None:
    assert infinite_cycle(schema) is None


def test_bounds_are_added_tightened_and_data_left_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "y": {"type": ["integer", "null"], "minimum": 3, "maximum": 1e20},
            "z": {"type": "number", "exclusiveMinimum": 0},
            "type": {"enum": [{"type": "number"}]},
        },
        "$defs": {"n": {"type": "number", "multipleOf": 0.5}},
    }
    limit = 10**INTEGER_DIGITS - 1
    bounded = bound_numbers(schema, multiple_of=True)
    assert bounded["properties"]["x"] == {
        "type": "number", "minimum": -limit, "maximum": limit, "multipleOf": 10.0**-FRACTION_DIGITS,
    }
    assert bounded["properties"]["y"] == {
        "type": ["integer", "null"], "minimum": 3, "maximum": limit,
    }
    assert "minimum" not in bounded["properties"]["z"]
    assert bound_numbers({"type": "number", "exclusiveMinimum": -1e300, "minimum": -1e300,
                          "exclusiveMaximum": 5}, multiple_of=False) == {
        "type": "number", "exclusiveMinimum": -(limit + 1), "minimum": -limit,
        "exclusiveMaximum": 5}
    nan = float("nan")  # Python's JSON reader takes NaN
    assert bound_numbers({"type": "integer", "maximum": nan, "exclusiveMinimum": nan},
                         multiple_of=False) == {
        "type": "integer", "maximum": limit, "exclusiveMinimum": -(limit + 1)}
    # Draft 7's `dependencies` maps names to a schema or to other names, and is not one.
    depends = {"type": "object", "dependencies": {"type": ["number"], "b": {"type": "integer"}}}
    assert bound_numbers(depends, multiple_of=False)["dependencies"] == {
        "type": ["number"], "b": {"type": "integer", "minimum": -limit, "maximum": limit}}
    assert bounded["properties"]["type"] == schema["properties"]["type"]
    assert bounded["$defs"]["n"]["multipleOf"] == 0.5
    assert "multipleOf" not in bound_numbers(schema, multiple_of=False)["properties"]["x"]
    assert schema["properties"]["x"] == {"type": "number"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def accepts(tokenizer):
    """For each engine, whether it accepts a text typed one character (one token) at a time."""
    llg = llg_tokenizer(tokenizer, len(tokenizer))
    xgrammar = make_grammar_backend("xgrammar", tokenizer, len(tokenizer))

    def by_llguidance(schema, text):
        matcher = LLMatcher(llg, compile_constraint(llg, "json_schema", schema), log_level=0)
        ids = [tokenizer.convert_tokens_to_ids(ch) for ch in text]
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    def by_xgrammar(schema, text):
        compiled = xgrammar.compile_json_schema(bound_numbers(schema, multiple_of=False))
        matcher = xgrammar.create_matcher(compiled)
        ids = [tokenizer.convert_tokens_to_ids(ch) for ch in text]
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return {"llguidance": by_llguidance, "xgrammar": by_xgrammar}


@pytest.mark.parametrize("schema", [
    {"type": "number"}, {"type": "number", "minimum": 0}, {"type": "integer"},
    # xgrammar refused these bounds ("out of enforceable range"); llguidance wrote any digits
    {"type": "number", "exclusiveMinimum": -1e300, "exclusiveMaximum": 1e300},
])
def test_both_engines_write_numbers_by_the_one_rule(tokenizer, schema) -> None:
    integer = schema["type"] == "integer"
    negative = "minimum" not in schema
    # The longest number under the bound 10**INTEGER_DIGITS - 1.
    most = "9" * (INTEGER_DIGITS - 1) + "8" + ("" if integer else "." + "9" * FRACTION_DIGITS)
    cases = {
        most: True,
        "-" + most: negative,
        "1" + most: False,
        "1e5": False,
        "0." + "5" * (FRACTION_DIGITS + 1): False,
        "0." + "5" * FRACTION_DIGITS: not integer,
    }
    rng = random.Random(0)
    for _ in range(30):
        whole = str(rng.randrange(10 ** rng.randint(0, INTEGER_DIGITS)))
        fraction = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
        cases[f"{whole}.{fraction}"] = not integer and len(fraction) <= FRACTION_DIGITS
    for engine, accept in accepts(tokenizer).items():
        for text, want in cases.items():
            assert accept(schema, text) == want, (engine, schema, text)


def nested(levels: int) -> dict:
    """`levels` objects, one inside the other: 2 JSON levels each, a string at the core."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def numbers(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": ["integer", "null"]}
                                             for i in range(count)}}


def test_a_schema_past_the_size_a_request_may_ask_for_is_refused() -> None:
    prepare(nested(MAX_DEPTH // 2 - 1), multiple_of=False)
    with pytest.raises(SchemaError, match=f"nests deeper than {MAX_DEPTH} levels"):
        prepare(nested(MAX_DEPTH // 2), multiple_of=False)  # JSON levels, `properties` too
    prepare(numbers(MAX_NUMBERS), multiple_of=False)
    # Numbers in data (enum, const, default) are not subschemas; data nests too.
    prepare({"enum": [{"type": "integer"}] * 1000, "const": 5}, multiple_of=False)
    with pytest.raises(SchemaError, match=f"nests deeper than {MAX_DEPTH} levels"):
        prepare(nested(5000), multiple_of=False)  # measured without recursion
    with pytest.raises(SchemaError, match=f"nests deeper than {MAX_DEPTH}"):
        prepare({"const": nested(MAX_DEPTH)}, multiple_of=False)
    with pytest.raises(SchemaError, match=f"holds {MAX_NUMBERS + 1} number or integer"):
        prepare(numbers(MAX_NUMBERS + 1), multiple_of=False)


@pytest.mark.parametrize("name", ["description", "enum", "const", "default", "required"])
def test_a_property_named_like_a_data_keyword_is_a_schema(name) -> None:
    """A property's name is not a keyword: what a property called `description` holds was
    read as data, so its numbers went uncounted (5,000 of them grew the server's worker
    until it was killed) and its refs unfollowed."""
    with pytest.raises(SchemaError, match=f"holds {MAX_NUMBERS + 1} number or integer"):
        prepare({"type": "object", "properties": {name: numbers(MAX_NUMBERS + 1)}},
                multiple_of=False)
    looped = {"type": "object", "properties": {name: {"$ref": "#"}}, "required": [name]}
    assert infinite_cycle(looped) == f"# (via property {name!r}) -> #"
    bounded = bound_numbers({"properties": {name: {"type": "integer"}}}, multiple_of=False)
    assert bounded["properties"][name]["maximum"] == 10**INTEGER_DIGITS - 1


def chain(links: int, last: object) -> dict:
    """`links` definitions, each requiring the next; the last is `last`."""
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["n"]} for i in range(links)}
    return {"$defs": {**defs, f"d{links}": last}, "$ref": "#/$defs/d0"}


def diamonds(layers: int) -> dict:
    """Each layer requires two definitions that both require the next layer, whose last
    requires a property that has no value (`false`): 2**layers paths and no cycle."""
    defs = {f"l{layers}": {"type": "object", "properties": {"z": False}, "required": ["z"]}}
    for i in range(layers):
        defs[f"l{i}"] = {"type": "object", "required": ["x", "y"], "properties": {
            side: {"$ref": f"#/$defs/{side}{i}"} for side in "xy"}}
        for side in "xy":
            defs[f"{side}{i}"] = {"type": "object", "required": ["z"],
                                  "properties": {"z": {"$ref": f"#/$defs/l{i + 1}"}}}
    return {"$defs": defs, "$ref": "#/$defs/l0"}


def padded_chain(links: int, padding: int) -> dict:
    """`chain(links)` and a definition `f` that uses every link and holds `padding` empty
    items beside them, required by the root."""
    schema = chain(links, {"type": "string"})
    schema["$defs"]["f"] = {"allOf": [{"$ref": f"#/$defs/d{i}"} for i in range(links + 1)]
                            + [{} for _ in range(padding)]}
    return {**schema, "type": "object", "required": ["f"],
            "properties": {"f": {"$ref": "#/$defs/f"}}}


@pytest.mark.parametrize("schema, most", [
    (chain(250, {"type": "string"}), 6 * 251),  # each link was read once per link before it
    (diamonds(40), 6 * 121),  # each followed along each of 2**40 paths
    ({"type": "array", "minItems": 10**12, "items": {"type": "string"}}, 4),  # once per item
    # `f` was read again each time one of its links was found finite: 2 s of the API's
    # event loop for a body of 62 KB.
    (padded_chain(250, 8000), 8 * 251 + 8001),
])
def test_the_finite_value_check_reads_each_part_once(monkeypatch, schema, most) -> None:
    """Each subschema the check reads becomes one term of a formula, and each term is
    settled once (`json_schemas._Formula`), however many refs lead to it and however
    they are ordered: a schema a client writes is checked in time linear in its size."""
    made = 0
    init = json_schemas._Term.__init__

    def counted(self, *args, **kwargs):
        nonlocal made
        made += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(json_schemas._Term, "__init__", counted)
    assert infinite_cycle(schema) is None
    assert made <= most


def test_a_long_cycle_is_named_by_its_ends() -> None:
    with pytest.raises(SchemaError) as refused:
        prepare(chain(250, {"$ref": "#/$defs/d0"}), multiple_of=False)
    assert ("#/$defs/d3 (via property 'n') -> ... 243 more ... -> #/$defs/d247 (via "
            "property 'n')") in str(refused.value)
    assert str(refused.value).endswith("-> #/$defs/d0 is required all the way round; make "
                                       "one property or item on that cycle optional.")


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": None, "required": ["a"]},
    {"type": "object", "properties": [1], "required": ["a"]},
    {"type": "object", "required": [[1], 5]},
    {"type": "object", "required": 5},
    {"type": [["object"]], "required": ["a"]},
    {"type": "array", "minItems": float("inf")},
    {"type": "array", "minItems": 1e400},
    {"type": "array", "minItems": "3", "prefixItems": {"a": 1}},
    {"allOf": 5, "anyOf": {"a": 1}, "oneOf": None},
    {"type": "integer", "minimum": "a", "maximum": None},
])
def test_keywords_of_the_wrong_shape_are_left_for_the_engine_to_name(schema) -> None:
    """What the check cannot read blocks nothing (xgrammar refuses it in its own words:
    `tests/test_serve_structured_output.py`); it raised `AttributeError`, `TypeError` or
    `OverflowError`, answered 500."""
    assert prepare(schema, multiple_of=False) is not None


def test_a_cycle_is_followed_without_python_s_recursion(monkeypatch) -> None:
    """A chain of 1,500 links raised `RecursionError` (answered 500)."""
    monkeypatch.setattr(json_schemas, "MAX_REFS", 2000)
    with pytest.raises(SchemaError, match="1493 more"):
        prepare(chain(1500, {"$ref": "#/$defs/d0"}), multiple_of=False)


def test_a_schema_of_more_refs_than_served_is_refused() -> None:
    with pytest.raises(SchemaError, match="holds 258 distinct \\$refs; at most 256"):
        prepare(chain(257, {"type": "string"}), multiple_of=False)


@pytest.mark.parametrize("schema", [
    {"default": {"$ref": "#/x"}, "$ref": "#/default"},  # a ref inside data, pointed at
    {"type": "object", "properties": {"a": {"enum": [{"$ref": "#/b"}]}},
     "anyOf": [{"$ref": "#/properties/a/enum/0"}]},
    {"type": "array", "prefixItems": [{"type": "string"}], "anyOf": [
        {"$ref": "#/prefixItems/\u00b2"}, {"$ref": "#/prefixItems/" + "0" * 5000},
        {"$ref": "#/prefixItems/\u0660"}]},  # no index: superscript 2, 5000 zeros, Arabic 0
])
def test_refs_the_check_does_not_follow_pass_it(schema) -> None:
    assert prepare(schema, multiple_of=False) is not None


def test_a_ref_into_a_long_list_is_read_off_its_digits() -> None:
    """Each ref's index was looked up by listing the list's indices: 256 refs into a
    list of 100,000 items held the API's event loop for seconds."""
    assert json_schemas._resolve({"L": [{}] * 100_000 + [{"type": "string"}]},
                                 "#/L/100000") == {"type": "string"}
    for part in ("100001", "0100000", "-1", "1e3", "", "\u0661"):
        assert json_schemas._resolve({"L": [{}] * 100_001}, f"#/L/{part}") is None
    schema = {"type": "object", "L": [0] * 100_000, "properties": {
        f"p{i}": {"$ref": f"#/L/{99_999 - i}"} for i in range(256)}}
    assert prepare(schema, multiple_of=False) is not None


@pytest.mark.parametrize(("text", "reason"), [
    ("[" * 100_000, "nests too deep to read"), ('{"type": ', "Expecting value"),
])
def test_a_schema_given_as_text_that_is_not_json_is_refused(text, reason, tokenizer) -> None:
    """The `Generator`'s `json_schema="[[[..."` raised a bare `RecursionError`; both
    engines' front doors read text through `loaded`."""
    with pytest.raises(SchemaError, match=f"json_schema is not valid JSON: .*{reason}"):
        loaded(text)
    with pytest.raises(ValueError, match=reason):
        compile_constraint(llg_tokenizer(tokenizer, len(tokenizer)), "json_schema", text)
    assert loaded('{"type": "string"}') == loaded({"type": "string"}) == {"type": "string"}
