"""`shims.echo_answers`: an echoing completion's choice, whole or streamed, gets its
prompt's text first and a `null` first entry in each log-probability list; other
requests' answers pass as MAX makes them.

That a served echo answers in OpenAI's shape, across prefill chunks too, is tested in
`tests/test_serve.py`.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from max.serve.router.openai_routes import CompletionResponseChoice
from max.serve.schemas.openai import CompletionLogprobs

from gpt2_max.shims import echo_answers

pytestmark = pytest.mark.tier("unit")


class Delegate:
    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


PIPELINE = SimpleNamespace(tokenizer=SimpleNamespace(delegate=Delegate()))


def request(prompt, echo: bool = True) -> SimpleNamespace:
    return SimpleNamespace(prompt=prompt, echo=echo)


def choice(logprobs: bool = True) -> CompletionResponseChoice:
    return CompletionResponseChoice(
        index=0, text=" next", finish_reason="length",
        logprobs=CompletionLogprobs(token_logprobs=[-1.0, -2.0],
                                    top_logprobs=[{"a": -1.0}, {"b": -2.0}])
        if logprobs else None,
    )


def test_a_whole_answer_echoes_each_prompt_of_an_echoing_request() -> None:
    async def complete(self, requests):
        return SimpleNamespace(choices=[choice(), choice(logprobs=False), choice()])

    answer = echo_answers.echoes_complete(complete)
    requests = [request([1, 2]), request("Hi"), request("Hi", echo=False)]
    response = asyncio.run(answer(SimpleNamespace(pipeline=PIPELINE), requests))
    first, second, third = response.choices
    assert first.text == "<1><2> next"
    assert first.logprobs.token_logprobs == [None, -1.0, -2.0]
    assert first.logprobs.top_logprobs == [None, {"a": -1.0}, {"b": -2.0}]
    assert json.loads(first.model_dump_json())["logprobs"]["token_logprobs"][0] is None
    assert (second.text, second.logprobs) == ("Hi next", None)
    unasked = choice()
    unasked.logprobs = CompletionLogprobs(token_logprobs=[], top_logprobs=[])
    echo_answers.echoed(unasked, "Hi")
    assert unasked.logprobs.token_logprobs == unasked.logprobs.top_logprobs == []
    assert third.text == " next" and third.logprobs.token_logprobs == [-1.0, -2.0]


def stream_of(*chunks):
    async def stream(self, request):
        async def payloads():
            for chunk in chunks:
                yield chunk
        return payloads()
    return echo_answers.echoes_stream(stream)


async def collect(answer, echo: bool = True) -> list:
    chunks = await answer(SimpleNamespace(pipeline=PIPELINE), request("Hé ", echo))
    return [chunk async for chunk in chunks]


def test_a_stream_echoes_in_its_first_chunk_with_a_choice() -> None:
    first = {"choices": [{"text": "a", "logprobs": {"token_logprobs": [-1.0, -0.5],
                                                     "top_logprobs": [{"x": -1.0}, {"a": -0.5}],
                                                     "tokens": None}}]}
    later = {"choices": [{"text": "b", "logprobs": {"token_logprobs": [-3.0],
                                                     "top_logprobs": [{"b": -3.0}]}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    chunks = [json.dumps(usage), json.dumps(first), json.dumps(later), "[DONE]"]
    out = asyncio.run(collect(stream_of(*chunks)))
    assert out[0] == chunks[0] and out[2:] == chunks[2:]
    echoed = json.loads(out[1])["choices"][0]
    assert echoed["text"] == "Hé a"
    assert echoed["logprobs"]["token_logprobs"] == [None, -1.0, -0.5]
    assert echoed["logprobs"]["top_logprobs"] == [None, {"x": -1.0}, {"a": -0.5}]
    assert "Hé" in out[1]  # as MAX writes its chunks: UTF-8, not escaped


def test_a_stream_that_does_not_echo_or_failed_passes_as_it_is() -> None:
    chunk = json.dumps({"choices": [{"text": "a"}]})
    assert asyncio.run(collect(stream_of(chunk), echo=False)) == [chunk]
    assert asyncio.run(collect(stream_of("[DONE]"))) == ["[DONE]"]  # cancelled before a token

    async def failed(self, request):
        return "an error response"

    answer = echo_answers.echoes_stream(failed)
    assert asyncio.run(answer(SimpleNamespace(pipeline=PIPELINE), request("Hi"))) == \
        "an error response"
