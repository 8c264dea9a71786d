"""Hostile requests to `max serve` of the package: no 5xx, no hang, the server exact after.

Every field of the OpenAI completions and chat bodies the server accepts is drawn
alone and in combination, from values a client means (so generation runs) and
hostile ones (wrong types, huge and negative numbers, NaN and infinities, long
strings, lone surrogates, nesting); bodies are sent plain and streamed, and each
goes out beside a well-formed greedy request whose tokens must stay transformers'
exact ones. Raw bodies and odd paths and methods too. What every answer must be:
below 500, in `TIMEOUT_S`; a 4xx with an error message; a stream without an error
event; a whole answer counting what it says (`check_counts`). `hypothesis` draws the
cases: seeded (`derandomize`), as many a test as the profile says
(`tests/conftest.py`: a short slice by default, `--hypothesis-profile long` for the
long run); `--hypothesis-show-statistics` prints the outcomes by kind.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.testing.load import GREEDY

pytestmark = pytest.mark.tier("fuzz")

TIMEOUT_S = 120
"""The longest any answer may take (a full window of tokens takes a few seconds)."""

CHECK_PROMPT = [15496, 995, 11, 616, 1438, 318]
CHECK_TOKENS = 6

ids = st.integers(0, GPT2_VOCAB_SIZE - 1)
hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
    st.sampled_from([2**63, 2**64, -(2**63) - 1]),  # past the 64 bits a queued request holds
    st.text(max_size=40), st.just("\ud800"), st.just("x" * 100_000),
    st.lists(st.integers(-(2**40), 2**40), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.recursive(st.integers(), lambda inner: st.lists(inner, max_size=2), max_leaves=40),
)
"""Values no field means: wrong types, out-of-range numbers, NaN, long and odd text."""


prompts = st.one_of(
    st.text(max_size=60), st.lists(ids, max_size=40),
    st.lists(st.lists(ids, max_size=6), max_size=3), st.lists(st.text(max_size=10), max_size=3),
)
stops = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))
SAMPLING = {
    "max_tokens": st.integers(1, 24),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-1, 100), st.sampled_from([GPT2_VOCAB_SIZE + 1, 2**31, 2**62])),
    "min_p": st.floats(0, 1),
    # The session server is started without --enable-penalties or --enable-min-tokens,
    # which refuses other values (`request_bodies.check_settings`; `hostile` draws them).
    "frequency_penalty": st.just(0.0),
    "presence_penalty": st.just(0.0),
    "repetition_penalty": st.just(1.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": stops,
    "stop_token_ids": st.lists(ids, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),  # the one choice served; another is refused (`shims.request_bodies`)
    "logit_bias": st.just({}),
    "user": st.text(max_size=8),
    "ignore_eos": st.booleans(),
    "min_tokens": st.just(0),
    "return_token_ids": st.booleans(),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    ]),
}
COMPLETIONS = {
    **SAMPLING,
    "prompt": prompts,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "best_of": st.just(1),
    "suffix": st.just(""),
}
messages = st.lists(
    st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(
            st.text(max_size=40),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
                     max_size=2),
        ),
    }),
    max_size=4,
)
CHAT = {
    **SAMPLING,
    "messages": messages,
    "max_completion_tokens": st.integers(1, 24),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
}


def bodies(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy:
    """Bodies with `model`, `required` and any of the other fields: all values a client
    means (so generation runs), or one field (perhaps one no body has) hostile, or
    every field drawn either way."""
    optional = {name: value for name, value in fields.items() if name != required}
    meant = st.fixed_dictionaries({"model": st.just("gpt2"), required: fields[required]},
                                  optional=optional)
    one_hostile = st.tuples(
        meant, st.sampled_from(["model", *fields, "unknown_field"]), hostile
    ).map(lambda drawn: {**drawn[0], drawn[1]: drawn[2]})
    anything = st.fixed_dictionaries(
        {"model": st.one_of(st.just("gpt2"), hostile),
         required: st.one_of(fields[required], hostile)},
        optional={name: st.one_of(value, hostile) for name, value in optional.items()},
    )
    return st.one_of(meant, one_hostile, anything)


def check_answer(status: int, text: str, what: str) -> None:
    """No 5xx; a 4xx says why; a 200 stream carries no error event."""
    event(f"{what}: {status}")
    assert status < 500, text[:500]
    if status >= 400:  # MAX's routes say {"error": {"message"}}, FastAPI's {"detail"}
        answer = json.loads(text) if text.startswith("{") else {}
        error = answer.get("error")
        message = (error.get("message") if isinstance(error, dict) else error) or answer.get(
            "detail") or text
        assert str(message).strip(), text[:500]
    elif "data:" in text:
        for line in text.splitlines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[len("data: "):]), line[:500]


def check_counts(body: dict[str, Any], status: int, text: str) -> None:
    """A whole (not streamed) 200 answer counts what it says it does: the token ids it
    returns are `usage.completion_tokens`, and each token's alternatives are as many as
    the body asked (a chat's `top_logprobs`, none if unset), or for a completion at most
    one more (MAX adds the sampled token where it is not among the `logprobs` best, as
    OpenAI's API does; tokens that decode alike share a key). A count given other than
    as an integer (`"2"`, which the schema reads as 2) is not checked."""
    if status != 200 or not text.startswith("{"):
        return
    answer = json.loads(text)
    choices = answer["choices"]
    if body.get("return_token_ids") is True and not body.get("echo"):
        assert sum(len(c["token_ids"]) for c in choices) == answer["usage"][
            "completion_tokens"], text[:500]
    for choice in choices:
        logprobs = choice.get("logprobs")
        if "messages" in body and body.get("logprobs") is True and logprobs:
            asked = body.get("top_logprobs") or 0
            if type(asked) is int:
                assert all(len(t["top_logprobs"]) == asked for t in logprobs["content"]), \
                    text[:500]
        elif "prompt" in body and logprobs and logprobs["token_logprobs"]:
            asked = body["logprobs"]
            if type(asked) is int:
                assert all(len(top) <= asked + 1 for top in logprobs["top_logprobs"]
                           if top is not None), text[:500]
            assert len(logprobs["top_logprobs"]) == len(logprobs["token_logprobs"]), text[:500]


def dumps(body: Any) -> bytes:
    """`body` as JSON, NaN and infinities as Python writes them, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


async def exchange(url: str, path: str, content: bytes, method: str = "POST") -> tuple[int, str]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        response = await client.request(
            method, f"{url}{path}", content=content,
            headers={"content-type": "application/json"},
        )
        return response.status_code, response.text


async def greedy_check(url: str) -> list[int]:
    body = {"model": "gpt2", "prompt": CHECK_PROMPT, "max_tokens": CHECK_TOKENS,
            "temperature": 0, **GREEDY["extra_body"]}
    status, text = await exchange(url, "/v1/completions", json.dumps(body).encode())
    assert status == 200, text[:500]
    return json.loads(text)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def served(gpt2_max_structured_server):
    """The structured-output session server (so `response_format` is served) and the
    greedy tokens its check request must get."""
    server = gpt2_max_structured_server
    return server.url, server.reference.greedy(CHECK_PROMPT, CHECK_TOKENS)


def send_beside_check(served, path: str, content: bytes, what: str, method: str = "POST",
                      body: Any = None):
    url, expected = served

    async def both():
        return await asyncio.gather(exchange(url, path, content, method), greedy_check(url))

    (status, text), tokens = asyncio.run(both())
    check_answer(status, text, what)
    if isinstance(body, dict):
        check_counts(body, status, text)
    assert tokens == expected


@given(body=bodies(COMPLETIONS, "prompt"))
def test_completions_bodies(served, body):
    send_beside_check(served, "/v1/completions", dumps(body), "completions", body=body)


@given(body=bodies(CHAT, "messages"))
def test_chat_bodies(served, body):
    send_beside_check(served, "/v1/chat/completions", dumps(body), "chat", body=body)


@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                          "/v1/embeddings", "/v1/responses", "/health", "/v1/../v1/completions",
                          "/v1/completions/%00", "/" + "a" * 5000]),
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
    content=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.recursive(st.integers() | st.text(max_size=5),
                                   lambda inner: st.lists(inner, max_size=3)
                                   | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                   max_leaves=30).map(dumps)),
)
def test_raw_bodies_paths_and_methods(served, path, method, content):
    send_beside_check(served, path, content, f"raw {method}", method)

