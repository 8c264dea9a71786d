"""End to end: MAX's scoring routes, `/v1/decisions` and `/v1/systemone`, which
`max serve` exposes by default, on this package's model.

Each question is rendered with the chat template (the checkpoint's, or the package's
plain one) and its answer labels scored in one prefill step: the probabilities must
be transformers' at the last prompt position, and a request MAX 26.7 answered 500
(`shims.decisions`) gets 400 or its limit.
"""

from __future__ import annotations

import math

import httpx
import pytest

from gpt2_max.testing.reference import hf_logprobs
from gpt2_max.testing.server import MODEL_NAME

pytestmark = pytest.mark.tier("serve")

QUESTIONS = [
    {"id": "sky", "type": "yes_no", "question": "Is the sky blue?"},
    {"id": "colour", "type": "choice", "question": "Which colour is it?",
     "options": [{"name": "blue"}, {"name": "red"}, {"name": "green", "description": "grass"}]},
    {"id": "how", "type": "score", "question": "How blue is it?",
     "levels": ["not at all", "somewhat", "very"]},
]


@pytest.fixture(scope="module")
def server(gpt2_max_server):
    return gpt2_max_server.url


def decide(server: str, **body) -> httpx.Response:
    return httpx.post(f"{server}/v1/decisions",
                      json={"input": "The sky is blue today.", "questions": QUESTIONS, **body},
                      timeout=300)


def test_decisions_are_transformers_label_probabilities(server, hf_models):
    response = decide(server, temperature=0.5, return_prompt_token_ids=True)
    assert response.status_code == 200, response.text
    answer = response.json()
    prompts = 0
    for question in QUESTIONS:
        got = answer["answers"][question["id"]]
        prompt, labels = got["prompt_token_ids"], got["label_token_ids"]
        prompts += len(prompt)
        expected = hf_logprobs(hf_models("default"), prompt)[-1][labels]
        mass = sum(math.exp(value) for value in expected)
        assert got["label_mass"] == pytest.approx(mass, rel=1e-3)
        weights = [math.exp((value - max(expected)) / 0.5) for value in expected]
        assert list(got["probabilities"].values()) == pytest.approx(
            [w / sum(weights) for w in weights], abs=1e-4)
    assert answer["usage"]["prompt_tokens"] == prompts
    assert answer["usage"]["completion_tokens"] == 0


def test_a_temperature_too_small_to_divide_by_gives_the_top_label_everything(server):
    """MAX's softmax divides each log-probability by it and answered 500 (NaN)."""
    warm = decide(server, temperature=1.0)
    assert warm.status_code == 200, warm.text
    cold = decide(server, temperature=5e-324)
    assert cold.status_code == 200, cold.text
    for question in QUESTIONS:
        spread = warm.json()["answers"][question["id"]]["probabilities"]
        top = max(spread, key=spread.get)
        probabilities = cold.json()["answers"][question["id"]]["probabilities"]
        assert probabilities == {name: float(name == top) for name in spread}


@pytest.mark.parametrize("key", ["tools", "self", "messages", "tokenize"])
@pytest.mark.parametrize("route", ["decisions", "systemone"])
def test_template_kwargs_the_renderer_sets_itself_get_400(server, route, key):
    """`tools`, `self` and `messages` failed the renderer's call with a TypeError,
    answered 500; `tokenize` got 400 with transformers' words for it."""
    body = (
        {"input": "x", "questions": QUESTIONS} if route == "decisions" else
        {"model": MODEL_NAME, "state": "x",
         "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    )
    response = httpx.post(f"{server}/v1/{route}",
                          json={**body, "chat_template_kwargs": {key: []}}, timeout=300)
    assert response.status_code == 400, response.text
    assert f"chat_template_kwargs holds '{key}', which the server sets" in response.text
    assert decide(server).status_code == 200
