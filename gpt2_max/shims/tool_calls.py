"""Two regular expressions of MAX 26.7's chat route that a request can make take
exponential time on the API process's event loop, which then answers nothing more.

- `--tool-parser llama` finds the calls in a whole answer with
  `parser.json_utils.parse_json_from_text`, a recursive pattern (the `regex` module)
  whose whitespace groups sit side by side: on text like `"[ [ [ ...` left open (a
  model cut by `max_tokens`, or asked by a `response_format` to write it), each
  level doubles the time, 2 s at 15 levels. Its strings also take an escape only
  as two backslashes, so a call whose arguments hold `\n` or `\"` came apart into
  its keys. `json_values` finds the values with the `json` module's decoder tried
  at each place one can start: JSON's own strings, no backtracking, and at most
  quadratic in the answer's length.
- After an answer, the route checks it against the request's `response_format`
  schema and any call against its tool's parameters, for its log and metrics only
  (`_tool_call_validation`), with `jsonschema`, which runs each `pattern` and
  `patternProperties` of the client's schema through Python's `re`: `^(a+)+$`
  against forty `a` and a `!` never ends. A schema holding either keyword is
  left unchecked (`bounded_checks`), as MAX leaves a schema it cannot
  compile: that check never answers the client. `jsonschema` also walks every
  branch of `allOf`/`anyOf`/`oneOf` again for each way a `$ref` chain reaches it:
  thirty definitions each holding two refs to the next (1.5 KB) take hours. The
  validators it builds stop after `CHECK_STEPS` keyword checks an answer
  (`WithinSteps`), and an answer checked no further counts as conforming, as one
  whose check raises does in MAX.

Installed by `shims.install`; it acts in the API process, for every model served.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

_VALUE_START = re.compile(r'[-0-9tfn"\[{]')
"""The characters a JSON value (number, `true`, `false`, `null`, string, array,
object) starts with."""

REGEX_KEYWORDS = ('"pattern":', '"patternProperties":')
"""The JSON Schema keywords whose values `jsonschema` runs as regular expressions,
as they appear in the canonical JSON `_build_validator` is given (a key is always
followed by a colon there, a string value never)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def json_values(text: str) -> list[Any]:
    """The JSON values in `text`, leftmost first, each from where the last ended: what
    MAX's `parse_json_from_text` returns (no `NaN` or `Infinity`, as its pattern has
    none), found by decoding rather than by backtracking."""
    values: list[Any] = []
    cursor = 0
    while start := _VALUE_START.search(text, cursor):
        try:
            value, cursor = _DECODER.raw_decode(text, start.start())
        except (ValueError, RecursionError):
            cursor = start.start() + 1
            continue
        values.append(value)
    return values


CHECK_STEPS = 10_000
"""The keyword checks (`type`, `properties`, `$ref`, ...) the conformance log may spend
on one answer, each some microseconds of the API's event loop: enough for an answer of
hundreds of fields."""


class OutOfSteps(RuntimeError):
    """A conformance check past `CHECK_STEPS`."""


_steps = threading.local()


def _counted(check: Callable[..., Any]) -> Callable[..., Any]:
    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _steps.left = getattr(_steps, "left", CHECK_STEPS) - 1
        if _steps.left < 0:
            raise OutOfSteps(f"schema conformance check past {CHECK_STEPS} steps")
        return check(validator, value, instance, schema)

    return counted


@functools.cache
def _counting_validator() -> type:
    """Draft 7 (MAX's dialect) with every keyword check counted."""
    from jsonschema import Draft7Validator, validators

    counted = {keyword: _counted(check) for keyword, check in Draft7Validator.VALIDATORS.items()}
    return validators.extend(Draft7Validator, counted)


def _one_dialect(schema: Any) -> Any:
    """`schema` (a fresh copy) with every `"$schema": "<uri>"` taken out, at any depth:
    `jsonschema` switches to the dialect a subschema names wherever it meets one (MAX
    pins Draft 7 at the root only, and a `$ref` may point anywhere), and the validator
    it switches to would not be counted. Walked without recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$schema"), str):
                del node["$schema"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


class WithinSteps:
    """A validator whose `iter_errors`, the one method MAX's checks call, raises
    `OutOfSteps` after `CHECK_STEPS` keyword checks of one answer."""

    def __init__(self, schema: Any) -> None:
        self._validator = _counting_validator()(schema)

    def iter_errors(self, instance: Any) -> Iterator[Any]:
        _steps.left = CHECK_STEPS
        yield from self._validator.iter_errors(instance)


@functools.lru_cache(maxsize=1024)  # as many as MAX's cache of the validators it builds
def _within_steps(schema_key: str) -> WithinSteps:
    """The counted validator of a schema (canonical JSON), built once like MAX's: it holds
    no state of one check (the steps left are the thread's)."""
    return WithinSteps(_one_dialect(json.loads(schema_key)))


def bounded_checks(build: Callable[[str], Any]) -> Callable[[str], Any]:
    """MAX's cached `_build_validator`, which gives no validator (the answer counts as
    conforming) for a schema holding a regular expression (`REGEX_KEYWORDS`), and
    otherwise one that stops after `CHECK_STEPS` (`WithinSteps`)."""
    @functools.wraps(build)
    def built(schema_key: str) -> Any:
        if any(keyword in schema_key for keyword in REGEX_KEYWORDS):
            return None
        if build(schema_key) is None:  # MAX's verdict, cached: no validator for this schema
            return None
        return _within_steps(schema_key)

    built.bounded = True  # type: ignore[attr-defined]
    return built


def install() -> None:
    """Puts `json_values` where the llama tool parser and the chat route call
    `parse_json_from_text`, and `bounded_checks` around the conformance
    checks' validator builder (once). MAX's modules are imported here, not with this one: the
    validator's is private."""
    from max.serve import _tool_call_validation
    from max.serve.parser import llama_tool_parser
    from max.serve.router import openai_routes

    llama_tool_parser.parse_json_from_text = json_values
    openai_routes.parse_json_from_text = json_values
    build = _tool_call_validation._build_validator
    if not getattr(build, "bounded", False):
        _tool_call_validation._build_validator = bounded_checks(build)
