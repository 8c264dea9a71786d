"""`response_format` through `max serve --enable-structured-output` on the CPU (openai client).

One server (the plugin's `gpt2_max_structured_server`) and the session's
in-process `generator` (conftest), on the same checkpoint. The model has
random weights, so only the grammar makes its output parse: every answer (greedy,
streamed, seeded) is parsed and validated with `jsonschema`. Greedy answers
are also transformers' greedy under the server's own grammar (MAX's xgrammar
bitmask), token for token, and the `Generator` asked for that engine gives the
server's tokens, greedy and seeded. `json_object` is held to the same: greedy
is transformers' greedy under the grammar MAX compiles for it, and every
answer is JSON (or, cut by `max_tokens`, the start of JSON).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from transformers import AutoTokenizer

from gpt2_max.generate.constrained import compile_constraint, llg_tokenizer
from gpt2_max.generate.xgrammar_mask import compile_json_schema
from gpt2_max.shims.internals import openai_response_format
from gpt2_max.testing.load import expected_tokens, plan_requests, run_load
from gpt2_max.testing.reference import TINY, hf_xgrammar_greedy, server_grammar_backend
from gpt2_max.testing.schemas import SCHEMAS, UNBOUNDED_NUMBERS, UNBOUNDED_NUMBERS_LONGEST
from gpt2_max.tokenizer import TOKENIZER_DIR

pytestmark = pytest.mark.tier("serve")

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 256
SEEDS = range(3)
"""0 among them: MAX's chat route reads `seed=0` as no seed (`seed or randint(...)`),
which gpt2-max carries past it."""
TOKEN_IDS = {"return_token_ids": True}


def response_format(name: str) -> dict:
    strict = len(name) % 2 == 0  # half the schemas strict, half not
    return {"type": "json_schema",
            "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name],
                            "strict": strict}}


@pytest.fixture(scope="module")
def served(gpt2_max_structured_server):
    return gpt2_max_structured_server


def chat(served, name: str, **options):
    return served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
        response_format=response_format(name), extra_body=TOKEN_IDS, **options,
    )


@pytest.fixture(scope="module")
def greedy(served):
    """Each schema's greedy answer, asked once."""
    return {name: chat(served, name, temperature=0.0) for name in SCHEMAS}


@pytest.fixture(scope="module")
def sampled(served):
    """Each schema's answers sampled at temperature 1 with each of `SEEDS`, asked once."""
    return {
        name: [chat(served, name, temperature=1.0, seed=seed) for seed in SEEDS]
        for name in SCHEMAS
    }


def token_ids(response) -> list[int]:
    return response.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_streamed_and_sampled_answers_validate(served, greedy, sampled, name) -> None:
    schema = SCHEMAS[name]
    answers = [greedy[name].choices[0]] + [response.choices[0] for response in sampled[name]]
    for choice in answers:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        response_format=response_format(name), stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == answers[0].message.content
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_equals_transformers_under_the_servers_grammar(served, greedy, name) -> None:
    """Step by step: the highest logit among the tokens MAX's xgrammar bitmask allows."""
    prompt = greedy[name].choices[0].model_extra["prompt_token_ids"]
    expected = hf_xgrammar_greedy(served.reference.model, prompt, SCHEMAS[name], MAX_TOKENS)
    assert token_ids(greedy[name]) == expected


def test_xgrammar_allows_tokenizations_llguidance_forbids() -> None:
    """Why greedy under llguidance is not the server's greedy: with `{"` forced,
    llguidance allows only the canonical token `{"` (4895), xgrammar `{` (90) too."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    schema = SCHEMAS["nested-optional"]
    llg = llg_tokenizer(tokenizer, len(tokenizer))
    matcher = LLMatcher(llg, compile_constraint(llg, "json_schema", schema))
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    assert (allowed[90], allowed[4895]) == (0, 1)
    assert hf_xgrammar_allows(schema, [90, 4895]) == [True, True]


def hf_xgrammar_allows(schema: dict, tokens: list[int]) -> list[bool]:
    backend = server_grammar_backend()
    matcher = backend.create_matcher(compile_json_schema(backend, schema))
    bitmask = backend.allocate_token_bitmask(1, 50257)
    backend.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    return [bool(allowed[token]) for token in tokens]


@pytest.mark.parametrize("name", SCHEMAS)
def test_generator_with_the_servers_engine_gives_the_servers_tokens(
    generator, greedy, sampled, name
) -> None:
    """Same schema, prompt and seed: the same tokens from both front doors, greedy
    and sampled (the `Generator` runs MAX's bitmask sampler, as the server does)."""
    prompt = greedy[name].choices[0].model_extra["prompt_token_ids"]
    options = dict(json_schema=SCHEMAS[name], grammar_engine="xgrammar")
    result = generator.generate(prompt, MAX_TOKENS, temperature=0.0, **options)
    assert result.token_ids == token_ids(greedy[name])
    assert result.forced_tokens == 0
    for seed, response in zip(SEEDS, sampled[name], strict=True):
        result = generator.generate(prompt, MAX_TOKENS, temperature=1.0, seed=seed, **options)
        assert result.token_ids == token_ids(response), seed
        assert result.text == response.choices[0].message.content


JSON_OBJECT = {"type": "json_object"}


def json_prefix(text: str) -> bool:
    """Whether `text` is the start of some JSON document.

    Independent of both grammar engines: `text` is a prefix if one of a few
    short fillers (closing a string, a key, a literal, a number, an escape)
    and then the brackets still open make it parse.
    """
    for filler in JSON_FILLERS:
        candidate = text + filler
        opened: list[str] = []
        in_string = escaped = False
        for char in candidate:
            if in_string:
                escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            elif char == '"':
                in_string = True
            elif char in "[{":
                opened.append("]" if char == "[" else "}")
            elif char in "]}" and opened:
                opened.pop()
        try:
            json.loads(candidate + "".join(reversed(opened)))
        except json.JSONDecodeError:
            continue
        return True
    return False


JSON_FILLERS = ["", '"', "0", '":0', ":0", '"k":0', "n", 'n"', "0000", '0000"', "000", '000"',
                "00", '00"', '0"', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l"]


def assert_json_object(text: str, finish_reason: str) -> None:
    """A whole JSON object when the grammar ended it, its start when `max_tokens` did."""
    assert text.startswith("{"), text
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish_reason == "length" and json_prefix(text), (finish_reason, text)


def test_json_prefix_tells_starts_of_json_from_other_text() -> None:
    for text in ['{"a":[1,-', '{"a', '{"a":"b\\', '{"a":"\\u00', '{"a":tr', '{"a":1.', '[{},',
                 '{"a":{"b":null},"c']:
        assert json_prefix(text), text
    for text in ['{"a"}', '{"a":1}}', "{,", '{"a":tx', '[1,]', '{"a":01']:
        assert not json_prefix(text), text


@pytest.fixture(scope="module")
def json_object_greedy(served):
    return served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        response_format=JSON_OBJECT, extra_body=TOKEN_IDS,
    )


def test_json_object_greedy_equals_transformers_under_maxs_object_grammar(
    served, json_object_greedy
) -> None:
    """MAX compiles `json_object` as its permissive object schema with xgrammar; greedy
    under that grammar's bitmask, streamed too, and JSON (or its start) each time."""
    choice = json_object_greedy.choices[0]
    schema = openai_response_format(JSON_OBJECT).json_schema
    assert schema == {"type": "object"}
    prompt = choice.model_extra["prompt_token_ids"]
    expected = hf_xgrammar_greedy(served.reference.model, prompt, schema, MAX_TOKENS)
    assert token_ids(json_object_greedy) == expected
    assert_json_object(choice.message.content, choice.finish_reason)
    stream = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        response_format=JSON_OBJECT, stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].finish_reason == choice.finish_reason


def test_json_object_from_the_generator(served, generator, json_object_greedy) -> None:
    """`json_object=True`: the server's tokens with its engine, greedy and seeded;
    JSON (or its start) with llguidance too."""
    prompt = json_object_greedy.choices[0].model_extra["prompt_token_ids"]
    result = generator.generate(
        prompt, MAX_TOKENS, temperature=0.0, json_object=True, grammar_engine="xgrammar"
    )
    assert result.token_ids == token_ids(json_object_greedy)
    for seed in SEEDS:
        response = served.client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0,
            seed=seed, response_format=JSON_OBJECT, extra_body=TOKEN_IDS,
        )
        result = generator.generate(prompt, MAX_TOKENS, temperature=1.0, seed=seed,
                                    json_object=True, grammar_engine="xgrammar")
        assert result.token_ids == token_ids(response), seed
        choice = response.choices[0]
        assert_json_object(choice.message.content, choice.finish_reason)
    for seed in SEEDS:
        result = generator.generate(prompt, 64, temperature=1.0, seed=seed, json_object=True)
        assert_json_object(result.text, result.finish_reason)
    # `json_schema={}` is a constraint too (any JSON value), as MAX reads it.
    anything = generator.generate(prompt, 64, json_schema={}, grammar_engine="xgrammar")
    if anything.finish_reason == "stop":
        json.loads(anything.text)
    else:
        assert anything.text and json_prefix(anything.text), anything.text


CYCLE = {
    "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                       "required": ["next"]}},
    "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"],
}


NESTED_40: dict = {"type": "string"}
for _ in range(40):
    NESTED_40 = {"type": "object", "properties": {"a": NESTED_40}}


@pytest.mark.parametrize(
    "schema, reason",
    [
        (CYCLE, "#/$defs/node (via property 'next') -> #/$defs/node"),
        ({"type": "string", "pattern": "(("}, "The parenthesis is not closed"),
        # xgrammar refuses multipleOf outright (docs/structured-output.md: bounded numbers).
        ({"type": "number", "multipleOf": 0.5}, "unsupported schema keyword: multipleOf"),
        ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum greater than maximum"),
        # 200 bounded integers: past MAX_NUMBERS, whose grammars' memory killed the worker
        # at 5000 (benchmarks/results/2026-11-29-hostile-requests.md).
        ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}},
         "json_schema holds 200 number or integer fields; at most 128 are served"),
        (NESTED_40, "json_schema nests deeper than 64 levels"),
    ],
    ids=["no-finite-value", "bad-pattern", "multipleOf", "empty-range", "200-integers",
         "nested-40-objects"],
)
def test_bad_schemas_get_400_with_the_reason_and_the_server_keeps_serving(
    served, schema, reason
) -> None:
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "bad", "schema": schema}}}
    response = httpx.post(  # `json.dumps` writes an infinite float as JSON's `Infinity`
        f"{served.url}/v1/chat/completions", content=json.dumps(body),
        headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert reason in response.text
    prompt = [464, 2068, 7586, 21831]
    after = served.client.completions.create(
        model=served.model, prompt=prompt, max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert token_ids(after) == served.reference.greedy(prompt, 6)


# Keywords of the wrong shape, and schemas the finite-value check once took time
# exponential (2**40 paths) or linear in a count (10**12 items) to read, reach
# xgrammar, which names what it cannot compile.
DIAMONDS: dict = {"$defs": {"l40": {"type": "object", "properties": {"z": False},
                                    "required": ["z"]}}, "$ref": "#/$defs/l0"}
for i in range(40):
    DIAMONDS["$defs"][f"l{i}"] = {"type": "object", "required": ["x", "y"], "properties": {
        side: {"$ref": f"#/$defs/{side}{i}"} for side in "xy"}}
    for side in "xy":
        DIAMONDS["$defs"][f"{side}{i}"] = {"type": "object", "required": ["z"],
                                           "properties": {"z": {"$ref": f"#/$defs/l{i + 1}"}}}


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"type": "object", "properties": None, "required": ["a"]},
         "properties must be an object"),
        ({"type": "array", "minItems": float("inf")}, "Failed to parse JSON"),
        ({"type": "integer", "minimum": "a"}, "Value must be a number"),
        ({"type": "array", "minItems": 10**12}, "Expect integer"),
        (DIAMONDS, "is forbidden by a false schema"),
    ],
    ids=["properties-null", "minItems-infinite", "minimum-text", "minItems-10**12", "diamonds"],
)
def test_schemas_the_check_cannot_read_are_named_by_the_engine(served, schema, reason) -> None:
    """They were answered 500 (`AttributeError`, `OverflowError`, `TypeError` in the
    check) or held the API process."""
    test_bad_schemas_get_400_with_the_reason_and_the_server_keeps_serving(
        served, schema, reason)


def test_a_text_response_format_is_free_text(served) -> None:
    """MAX's route made OpenAI's `{"type": "text"}` a constraint to any JSON value."""
    answers = [
        served.client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=12, temperature=0.0,
            extra_body={**TOKEN_IDS, "ignore_eos": True}, **format)
        for format in ({"response_format": {"type": "text"}}, {})
    ]
    assert token_ids(answers[0]) == token_ids(answers[1])
    assert not json_prefix(answers[0].choices[0].message.content)


def test_sixteen_concurrent_requests_mixing_constrained_and_free(served, greedy) -> None:
    free = plan_requests(8, TINY["n_positions"], distinct_prompts=4, max_prompt=24, seed=19)
    constrained = list(SCHEMAS)[:8]
    with ThreadPoolExecutor(len(constrained) + 1) as pool:
        load = pool.submit(run_load, served.url, free, len(free))
        answers = {name: pool.submit(chat, served, name, temperature=0.0) for name in constrained}
        report = load.result()
        answers = {name: answer.result() for name, answer in answers.items()}
    assert report.failed == {} and not report.duplicated
    assert report.completed == expected_tokens(served.reference.model, free, TINY["n_positions"])
    for name, response in answers.items():
        assert token_ids(response) == token_ids(greedy[name])
        jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMAS[name])


NUMBER_SEEDS = range(10)


def test_sampled_numbers_close_within_the_rules_bound(served) -> None:
    """Unbounded `number`s are written by `gpt2_max.json_schemas`' rule, so the answer closes."""
    for seed in NUMBER_SEEDS:
        response = chat(served, "numbers", temperature=1.0, seed=seed)
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        # The end-of-text token is counted too.
        assert response.usage.completion_tokens <= UNBOUNDED_NUMBERS_LONGEST + 1
        jsonschema.validate(json.loads(choice.message.content), UNBOUNDED_NUMBERS)


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar"])
def test_generator_sampled_numbers_close_within_the_rules_bound(generator, engine) -> None:
    prompts = [[464, 2068, 7586, 21831], [40, 716]]
    for seed in NUMBER_SEEDS:
        for result in generator.generate_batch(
            prompts, 2 * UNBOUNDED_NUMBERS_LONGEST, json_schema=UNBOUNDED_NUMBERS,
            grammar_engine=engine, temperature=1.0, seed=seed,
        ):
            assert result.finish_reason == "stop", result
            assert len(result.token_ids) <= UNBOUNDED_NUMBERS_LONGEST + 1
            jsonschema.validate(json.loads(result.text), UNBOUNDED_NUMBERS)


def test_completions_refuse_response_format_in_maxs_request_schema(served) -> None:
    """Not served, and said so: MAX's `/v1/completions` request model is OpenAI's
    completion params (no `response_format`) with `extra="forbid"`, so the field is
    answered 400 by pydantic before any step; the server keeps serving."""
    body = {"model": served.model, "prompt": [464, 2068], "max_tokens": 4,
            "response_format": {"type": "json_object"}}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "response_format" in response.text and "Extra inputs are not permitted" in response.text
    prompt = [464, 2068, 7586, 21831]
    after = served.client.completions.create(
        model=served.model, prompt=prompt, max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert token_ids(after) == served.reference.greedy(prompt, 6)
