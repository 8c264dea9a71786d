"""The JSON-schema rules both front doors apply before a grammar is compiled.

`gpt2_max.Generator` compiles schemas with llguidance, `max serve` with MAX's
xgrammar. Neither engine refuses a schema that has no finite value, and
neither bounds a plain `number`, so a sampling model can write digits until
`max_tokens` and return truncated JSON. `prepare` closes both gaps, the same
way for both engines:

- No finite value: a schema whose required properties (or minimum array
  items) lead back through `$ref` to where they started, with no branch out,
  describes only infinite documents. It is refused with the cycle named,
  before any step runs.
- Bounded numbers (`NUMBER_RULE`): every `number` and `integer` is written
  without an exponent, with at most `INTEGER_DIGITS` digits before the point,
  and a `number` with at most `FRACTION_DIGITS` after it. The schema's
  `minimum`/`maximum` are tightened to +-(10**INTEGER_DIGITS - 1) (a value
  already inside stays); xgrammar writes any bounded number with at most six
  fraction digits and no exponent, and llguidance is given the same limit as
  `multipleOf` 10**-FRACTION_DIGITS (xgrammar refuses `multipleOf`, so the
  server's schema does not carry it). `json_object` and `{}` are not touched:
  they name no number.

So a schema's longest number is `NUMBER_CHARS` characters, one token or more
each, and a constrained answer closes within a bound that the schema alone
fixes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

INTEGER_DIGITS = 15
FRACTION_DIGITS = 6
"""xgrammar's own fraction limit for a bounded number (`tests/test_json_schemas.py` checks it)."""
NUMBER_LIMIT = 10**INTEGER_DIGITS - 1
NUMBER_CHARS = 1 + INTEGER_DIGITS + 1 + FRACTION_DIGITS
"""The longest number the rule allows: sign, integer digits, point, fraction digits."""
NUMBER_RULE = (
    f"numbers have no exponent, at most {INTEGER_DIGITS} integer digits and "
    f"{FRACTION_DIGITS} fraction digits"
)

_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required", "description"})
"""Keywords whose values are data, not subschemas, and are never rewritten."""
_NAMED_SCHEMAS = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
    "dependencies",  # draft 7's: a name's schema, or a list of names
})
"""Keywords whose values map names to subschemas: a name there is not a keyword (a
property called `description` holds a schema)."""


def _children(node: Any, is_schema: bool = True) -> list[tuple[Any, bool, int]]:
    """The values inside `node` (a JSON value), each with whether it is a subschema and
    how many JSON levels down it sits (2 below a map of names): the one rule every walk
    of a schema here follows."""
    if isinstance(node, list):
        return [(item, is_schema, 1) for item in node]
    if not isinstance(node, dict):
        return []
    if not is_schema:
        return [(value, False, 1) for value in node.values()]
    children = []
    for key, value in node.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            children += [(sub, True, 2) for sub in value.values()]
        else:
            children.append((value, key not in _NOT_SCHEMAS, 1))
    return children

_VALUE_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


MAX_DEPTH = 64
"""The JSON nesting a schema may have. Python's recursion, in this module's walks and in
the engines' compilers, gives out near a thousand levels, and no schema a model is
asked to follow needs a tenth of that."""
MAX_REFS = 256
"""The distinct local `$ref`s a schema may hold. Whether each has a finite value is
settled in one pass (`_Formula`), but naming a cycle reads each definition found to
have none, and a ref may point into another's body, so their reads add up."""
MAX_NUMBERS = 128
"""The number and integer subschemas a schema may hold. The server's xgrammar compiles
each bounded number (`NUMBER_RULE`) to an automaton of its own, and their memory, in
the model worker, grows with their count until the worker is killed
(`benchmarks/results/2026-11-29-hostile-requests.md`)."""


class SchemaError(ValueError):
    """A schema that has no finite value, or is larger than a request may ask for."""


def loaded(schema: Any) -> Any:
    """`schema`, read first where it is JSON text. Raises `SchemaError` for text that is
    not JSON, or nests past what Python's reader follows (`RecursionError`)."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except (ValueError, RecursionError) as error:
        reason = "it nests too deep to read" if isinstance(error, RecursionError) else error
        raise SchemaError(f"json_schema is not valid JSON: {reason}") from None


def prepare(schema: Any, *, multiple_of: bool) -> Any:
    """`schema` checked for a finite value and with its numbers bounded (`NUMBER_RULE`).

    `multiple_of` adds the fraction limit as `multipleOf` (llguidance); without
    it the engine's own limit for bounded numbers applies (xgrammar).
    Raises `SchemaError` naming the cycle of a schema with no finite value, and for
    one past `MAX_DEPTH`, `MAX_NUMBERS` or `MAX_REFS`.
    """
    check_size(schema)
    if cycle := infinite_cycle(schema):
        raise SchemaError(
            f"json_schema has no finite value: {cycle} is required all the way round; "
            "make one property or item on that cycle optional."
        )
    return bound_numbers(schema, multiple_of=multiple_of)


def check_size(schema: Any) -> None:
    """Raises `SchemaError` for a schema nested past `MAX_DEPTH` or holding more than
    `MAX_NUMBERS` numbers; walked without recursion, so any depth is measured."""
    numbers = 0
    stack = [(schema, 1, True)]  # (node, its depth, whether it is a subschema)
    while stack:
        node, depth, is_schema = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"json_schema nests deeper than {MAX_DEPTH} levels.")
        if isinstance(node, dict):
            numbers += is_schema and bool(_types(node) & {"number", "integer"})
        stack.extend((child, depth + levels, sub)
                     for child, sub, levels in _children(node, is_schema))
    if numbers > MAX_NUMBERS:
        raise SchemaError(
            f"json_schema holds {numbers} number or integer fields; at most {MAX_NUMBERS} "
            "are served, each being a grammar of its own."
        )


def bound_numbers(schema: Any, *, multiple_of: bool) -> Any:
    """A copy of `schema` whose numbers follow `NUMBER_RULE` (see `prepare`)."""
    schema = copy.deepcopy(schema)
    _bound(schema, multiple_of)
    return schema


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    return {k for k in kinds if isinstance(k, str)}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> int | None:
    """A count keyword's value (`minItems`), or None where it is not a whole number,
    which the engines refuse in their own words."""
    if not _number(value):
        return None
    return int(value) if isinstance(value, int) or value.is_integer() else None


def _bound(node: Any, multiple_of: bool) -> None:
    if isinstance(node, list):
        for item in node:
            _bound(item, multiple_of)
        return
    if not isinstance(node, dict):
        return
    types = _types(node)
    if types & {"number", "integer"}:
        # A bound that is not a number is left as it is, for the engine to refuse. An
        # exclusive bound is tightened to one past the limit (xgrammar refuses one far
        # out, 1e300); the inclusive one is tightened, or added where neither is given.
        for keyword, exclusive, limit in (("minimum", "exclusiveMinimum", -NUMBER_LIMIT),
                                          ("maximum", "exclusiveMaximum", NUMBER_LIMIT)):
            tighter = max if limit < 0 else min
            # The limit first: `min` and `max` keep it against a NaN bound.
            if _number(bound := node.get(exclusive)):
                node[exclusive] = tighter(limit + (1 if limit > 0 else -1), bound)
            if (keyword in node or exclusive not in node) and _number(
                bound := node.get(keyword, limit)
            ):
                node[keyword] = tighter(limit, bound)
        if multiple_of and "number" in types and "multipleOf" not in node:
            node["multipleOf"] = 10.0**-FRACTION_DIGITS
    for child, is_schema, _ in _children(node):
        if is_schema:
            _bound(child, multiple_of)


def _index(part: str, length: int) -> int | None:
    """The list index a JSON pointer's `part` names in a list of `length` items, or
    None: read off the digits, where listing the indices cost a pass over a long list
    for each `$ref` into it."""
    if not (part.isascii() and part.isdigit()) or len(part) > len(str(length)):
        return None
    index = int(part)
    return index if index < length and str(index) == part else None


def _resolve(schema: Any, ref: str) -> Any:
    """The subschema a local `$ref` (`#/...`) points at, or None."""
    node = schema
    for part in ref.removeprefix("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and (index := _index(part, len(node))) is not None:
            node = node[index]
        else:
            return None
    return node


def _local_refs(node: Any, found: set[str]) -> set[str]:
    if isinstance(node, dict) and isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
        found.add(ref)
    for child, is_schema, _ in _children(node):
        if is_schema:
            _local_refs(child, found)
    return found


Blocked = list[tuple[str, str]]
"""(how it is reached, `$ref`) pairs that keep a schema from a finite value."""


class _Term:
    """A node of the formula that says whether a (sub)schema has a finite value: true
    once `need` of its children are (all of them for a schema's parts, one for a
    choice of branches; none is true for a choice of none). A `$ref` is a leaf whose
    one child is its definition's term."""

    __slots__ = ("children", "need", "parents", "ref", "true", "via")

    def __init__(self, children: list[_Term], need: int, ref: str = "", via: str = "") -> None:
        self.children, self.need, self.ref, self.via = children, need, ref, via
        self.parents: list[_Term] = []
        self.true = False
        for child in children:
            child.parents.append(self)


class _Formula:
    """The terms of a schema and of each local `$ref`'s definition, each subschema's
    built once, and which of them are true: the least fixed point, reached by visiting
    each term and each link once (a chain of refs is read once, not once per link).

    Structural only: whether a value of each required part exists, not whether string
    lengths or ranges can be met (the engines' compile checks those). A keyword of the
    wrong shape (`properties` not an object) blocks nothing here: the engine refuses
    it, naming it."""

    def __init__(self, schema: Any, refs: dict[str, Any]) -> None:
        self.terms: list[_Term] = []
        self._built: dict[int, _Term] = {}
        self._leaves: dict[str, list[_Term]] = {ref: [] for ref in refs}
        self.root = self._term(schema)
        self.definitions = {ref: self._term(True if target is None else target)
                            for ref, target in refs.items()}
        for ref, definition in self.definitions.items():
            for leaf in self._leaves[ref]:
                leaf.children.append(definition)
                definition.parents.append(leaf)
        ready = [term for term in self.terms if term.need <= 0]
        while ready:
            term = ready.pop()
            term.true = True
            for parent in term.parents:
                parent.need -= 1
                if parent.need == 0:
                    ready.append(parent)

    def _new(self, children: list[_Term], any_of: bool = False, **leaf: str) -> _Term:
        need = (1 if any_of else len(children)) if not leaf else 1
        self.terms.append(term := _Term(children, need, **leaf))
        return term

    def _term(self, node: Any, via: str = "") -> _Term:
        if not isinstance(node, dict):
            return self._new([], any_of=node is False)  # `false`: a choice of none
        if (known := self._built.get(id(node))) is not None:
            return known
        parts: list[_Term] = []
        if not ("const" in node or "enum" in node):
            if isinstance(ref := node.get("$ref"), str) and ref in self._leaves:
                parts.append(leaf := self._new([], ref=ref, via=via))
                self._leaves[ref].append(leaf)
            parts += [self._term(sub, via) for sub in _list(node.get("allOf"))]
            parts += [self._new([self._term(sub, via) for sub in node[key]], any_of=True)
                      for key in ("anyOf", "oneOf") if isinstance(node.get(key), list)]
            parts += self._by_type(node)
        self._built[id(node)] = term = self._new(parts)
        return term

    def _by_type(self, node: dict[str, Any]) -> list[_Term]:
        types = _types(node)
        if not types:
            if {"properties", "required", "additionalProperties"} & node.keys():
                types = {"object"}
            elif {"items", "prefixItems", "minItems"} & node.keys():
                types = {"array"}
        if not types or types & _VALUE_TYPES:
            return []
        ways = []
        if "object" in types:
            properties = node.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            extra = node.get("additionalProperties", True)
            ways.append(self._new([
                self._term(properties.get(name, extra if isinstance(extra, dict) else True),
                           f"property {name!r}")
                for name in _list(node.get("required")) if isinstance(name, str)
            ]))
        if "array" in types:
            prefix = _list(node.get("prefixItems"))
            least = max(0, _count(node.get("minItems", 0)) or 0)
            # Items past the prefix all follow `items`: the first of them stands for the rest.
            required = [*prefix[:least], *[node.get("items", True)][: least > len(prefix)]]
            ways.append(self._new([self._term(sub, f"item {index}")
                                   for index, sub in enumerate(required)]))
        return [self._new(ways, any_of=True)]


def _blocking(term: _Term) -> Blocked:
    """The refs not found finite that keep `term` false, each with how it is reached:
    the leaves under it through false terms, not through other definitions."""
    found: Blocked = []
    seen: set[int] = set()
    stack = [term]
    while stack:
        term = stack.pop()
        if term.true or id(term) in seen:
            continue
        seen.add(id(term))
        if term.ref:
            found.append((term.via, term.ref))
        else:
            stack += reversed(term.children)  # the first part first
    return found


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def infinite_cycle(schema: Any) -> str | None:
    """The `$ref` cycle that leaves `schema` no finite value, written out; else None.

    Which local `$ref`s have a finite value is the least fixed point of the schema's
    formula (`_Formula`); a schema blocked only by refs that lead back to themselves
    is named by one such cycle.
    """
    named = _local_refs(schema, set())
    if len(named) > MAX_REFS:
        raise SchemaError(
            f"json_schema holds {len(named)} distinct $refs; at most {MAX_REFS} are served."
        )
    formula = _Formula(schema, {ref: _resolve(schema, ref) for ref in named})
    if formula.root.true:
        return None
    edges = {ref: _blocking(term) for ref, term in formula.definitions.items() if not term.true}
    done: set[str] = set()
    for _, start in _blocking(formula.root):
        if cycle := _find_cycle(start, edges, done):
            return cycle
    return None


def _find_cycle(start: str, edges: dict[str, Blocked], done: set[str]) -> str | None:
    """Depth first along blocking refs from `start`; the first ref met again on the
    path closes the cycle. A ref whose every way on was followed (`done`) leads to
    none and is not followed again, so each ref is left once however many paths
    reach it; the path is kept in a list, not in Python's stack, so a chain of refs
    of any length is followed."""
    if start in done:
        return None
    path: list[tuple[str, str]] = []  # (ref, how the next is reached from it)
    on_path = {start}
    stack = [(start, iter(edges.get(start, [])))]
    while stack:
        ref, ways = stack[-1]
        for via, nxt in ways:
            if nxt in done:
                continue
            path.append((ref, via))
            if nxt in on_path:
                begin = next(i for i, (at, _) in enumerate(path) if at == nxt)
                return _cycle_text(path[begin:], nxt)
            on_path.add(nxt)
            stack.append((nxt, iter(edges.get(nxt, []))))
            break
        else:
            stack.pop()
            on_path.discard(ref)
            done.add(ref)
            if path:
                path.pop()
    return None


CYCLE_STEPS_SHOWN = 8
"""The steps of a cycle an error names: a long one is shown by its ends."""


def _cycle_text(steps: list[tuple[str, str]], closing: str) -> str:
    """`#/$defs/a` -> property 'b' -> `#/$defs/c` ... back to the first."""
    shown = [f"{ref} (via {via})" for ref, via in steps]
    if len(shown) > CYCLE_STEPS_SHOWN:
        half = CYCLE_STEPS_SHOWN // 2
        shown[half:-half] = [f"... {len(steps) - 2 * half} more ..."]
    return " -> ".join(shown) + f" -> {closing}"
