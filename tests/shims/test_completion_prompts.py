"""`completion_prompts`: the completions bodies MAX 26.7 answers 500, refused by name."""

from types import SimpleNamespace

import pytest
from max.pipelines.context.exceptions import InputError
from max.serve.router import openai_routes

from gpt2_max.shims import completion_prompts

pytestmark = pytest.mark.tier("unit")


def body(prompt, stream=False):
    return SimpleNamespace(prompt=prompt, stream=stream)


@pytest.mark.parametrize(
    "prompt, stream, message",
    [
        ([], False, "prompt is empty"),
        ([], True, "prompt is empty"),
        ([[1], [2]], True, "this request has 2"),
        (["a", "b", "c"], True, "this request has 3"),
    ],
)
def test_bodies_the_route_answers_500_are_refused_naming_the_cause(prompt, stream, message):
    with pytest.raises(InputError, match=message):
        completion_prompts.check(body(prompt, stream))


@pytest.mark.parametrize(
    "prompt, stream",
    [("", False), ("Hi", True), ([15496, 995], True), ([[1], [2]], False), (["a"], True)],
)
def test_other_bodies_pass(prompt, stream):
    completion_prompts.check(body(prompt, stream))


def test_the_parser_it_wraps_is_there_and_wrapped_once():
    completion_prompts.install()
    wrapped = openai_routes._parse_openai_request_body
    assert wrapped.checks_prompts
    completion_prompts.install()
    assert openai_routes._parse_openai_request_body is wrapped
