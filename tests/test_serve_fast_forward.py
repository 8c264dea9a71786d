"""Fast-forward tokens under `max serve` (`GPT2_MAX_FAST_FORWARD=1`, `shims.fast_forward`).

Two servers of one checkpoint: the plugin's structured-output server (MAX's
loop, one step a token) and the same with fast-forward on. Greedy answers
must be the same tokens, streamed text the same, free requests batched with
constrained ones still transformers' exact greedy, and the steps the server
ran (MAX's own `maxserve.batch_size` count on the metrics endpoint) fewer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import OpenAI

from gpt2_max.shims.fast_forward import ENV
from gpt2_max.testing.load import expected_tokens, plan_requests, run_load
from gpt2_max.testing.plugin import STRUCTURED_OUTPUT_ARGS, ServedGPT2
from gpt2_max.testing.reference import TINY
from gpt2_max.testing.schemas import SCHEMAS
from gpt2_max.testing.server import max_serve, steps_run

pytestmark = pytest.mark.tier("serve")

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def fast(gpt2_max_checkpoint, gpt2_max_reference, tmp_path_factory) -> Iterator[ServedGPT2]:
    log = tmp_path_factory.mktemp("gpt2-max-serve-ff") / "server.log"
    with max_serve(gpt2_max_checkpoint, *STRUCTURED_OUTPUT_ARGS, log=log, env={ENV: "1"}) as server:
        with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            served = ServedGPT2(url=server.url, model=server.model, pid=server.pid, client=client,
                                reference=gpt2_max_reference, checkpoint=gpt2_max_checkpoint,
                                log=log, metrics_url=server.metrics_url)
            yield served


@pytest.fixture(scope="module")
def slow(gpt2_max_structured_server) -> ServedGPT2:
    return gpt2_max_structured_server


def chat(served: ServedGPT2, name: str, **options):
    schema = {"name": name.replace("-", "_"), "schema": SCHEMAS[name]}
    return served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": schema},
        extra_body={"return_token_ids": True}, **{"temperature": 0.0, **options},
    )


def token_ids(response) -> list[int]:
    return response.choices[0].model_extra["token_ids"]


def ask_each_schema(served: ServedGPT2) -> dict[str, tuple]:
    """Each schema's greedy answer from `served`, one after another, with the steps
    each took: a settled count after one answer is the count before the next."""
    result = {}
    count = steps_run(served.metrics_url)
    for name in SCHEMAS:
        response = chat(served, name)
        after = steps_run(served.metrics_url)
        result[name] = (response, after - count)
        count = after
    return result


@pytest.fixture(scope="module")
def answers(fast, slow):
    """Each schema's greedy answer from both servers, with the steps each took.

    The servers are asked side by side: each counts only its own steps, and
    waiting for one's count to settle need not hold up the other.
    """
    with ThreadPoolExecutor(2) as pool:
        slow_answers, fast_answers = pool.map(ask_each_schema, (slow, fast))
    return {name: {"slow": slow_answers[name], "fast": fast_answers[name]} for name in SCHEMAS}


@pytest.mark.parametrize("name", SCHEMAS)
def test_fast_forward_keeps_every_token_and_saves_steps(fast, answers, name) -> None:
    slow_answer, slow_steps = answers[name]["slow"]
    fast_answer, fast_steps = answers[name]["fast"]
    assert token_ids(fast_answer) == token_ids(slow_answer)
    assert fast_answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(fast_answer.choices[0].message.content), SCHEMAS[name])
    # MAX's loop: one step for the prompt and its first token, then one per token.
    assert slow_steps == len(token_ids(slow_answer))
    assert fast_steps < slow_steps
    stream = fast.client.chat.completions.create(
        model=fast.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "s", "schema": SCHEMAS[name]}},
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == fast_answer.choices[0].message.content
    assert chunks[-1].finish_reason == "stop"


def test_steps_saved_per_schema_are_reported(answers) -> None:
    """Prints the table `docs/structured-output.md` quotes (steps are MAX's batch count)."""
    for name, pair in answers.items():
        print(f"{name}: {len(token_ids(pair['fast'][0]))} tokens, "
              f"{pair['slow'][1]} steps -> {pair['fast'][1]} steps")
    assert sum(p["fast"][1] for p in answers.values()) < sum(p["slow"][1] for p in answers.values())


def test_max_tokens_cuts_a_fast_forwarded_answer_where_maxs_loop_does(fast, slow) -> None:
    for max_tokens in (1, 2, 5, 9):
        cut = {side: served.client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "s", "schema": SCHEMAS["defs-ref"]}},
            extra_body={"return_token_ids": True},
        ) for side, served in (("slow", slow), ("fast", fast))}
        assert token_ids(cut["fast"]) == token_ids(cut["slow"])
        assert len(token_ids(cut["fast"])) == max_tokens
        assert cut["fast"].choices[0].finish_reason == "length"


def test_free_requests_batched_with_fast_forwarded_ones_stay_exact(fast, answers) -> None:
    free = plan_requests(8, TINY["n_positions"], distinct_prompts=4, max_prompt=24, seed=19)
    constrained = list(SCHEMAS)[:8]
    with ThreadPoolExecutor(len(constrained) + 1) as pool:
        load = pool.submit(run_load, fast.url, free, len(free))
        replies = {name: pool.submit(chat, fast, name) for name in constrained}
        report = load.result()
        replies = {name: reply.result() for name, reply in replies.items()}
    assert report.failed == {} and not report.duplicated
    assert report.completed == expected_tokens(fast.reference.model, free, TINY["n_positions"])
    for name, reply in replies.items():
        assert token_ids(reply) == token_ids(answers[name]["slow"][0])


SEEDS = range(1, 4)
"""Not 0: MAX's chat route reads `seed=0` as no seed."""


@pytest.mark.parametrize("name", list(SCHEMAS)[:5])
def test_seeded_draws_are_the_default_servers(fast, slow, name) -> None:
    """MAX keys a row's draw by its seed plus the context's length
    (`max/pipelines/sampling/seeds.py:45`), and a forced token is the only one
    a draw could give, so a seed draws the same tokens with fewer steps."""
    for seed in SEEDS:
        draws = [token_ids(chat(served, name, temperature=1.0, seed=seed))
                 for served in (slow, fast)]
        assert draws[0] == draws[1]
