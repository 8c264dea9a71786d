"""`max serve` on the GPU with no device or encoding flag: bfloat16, and MAX's serving
features through it, each answer checked against transformers or for its HTTP status."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.reference import random_prompt, stopped_text
from gpt2_max.testing.server import MODEL_NAME, child_env, max_executable, max_serve

from .parity import assert_clear_tokens_match, complete, reference_rows, token_ids

pytestmark = pytest.mark.tier("gpu")

SERVE_ARGS = (
    "--max-batch-size", "8",
    "--max-batch-input-tokens", "64",  # prompts past 64 tokens prefill in chunks
    "--max-batch-total-tokens", "8192",
    "--enable-echo",
    "--enable-structured-output",
)


@pytest.fixture(scope="module")
def served(gpu_checkpoint: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("gpu-serve") / "server.log"
    with max_serve(gpu_checkpoint, *SERVE_ARGS, log=log, devices=None) as running:
        yield running


@pytest.fixture(scope="module")
def api(served) -> OpenAI:
    with OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_plain_start_serves_bfloat16_on_the_gpu(served):
    log = served.log.read_text()
    assert "compiling the GPT-2 graph for bfloat16" in log, log[-3000:]


def test_concurrent_and_chunked_prompts_pick_transformers_clear_tokens(api, gpu_reference):
    prompts = [random_prompt(n, seed=n) for n in (1, 5, 33, 64, 100, 150, 200, 250)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: token_ids(complete(api, p, 24)), prompts))
    for prompt, tokens in zip(prompts, answers, strict=True):
        assert len(tokens) == 24
        assert_clear_tokens_match(gpu_reference, prompt, tokens)


def test_streaming_gives_the_same_tokens_in_pieces(api):
    prompt = random_prompt(20, seed=7)
    whole = token_ids(complete(api, prompt, 12))
    stream = api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True, **GREEDY
    )
    pieces = [token_ids(chunk.choices[0]) for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1
    assert sum(pieces, []) == whole


def test_chat_completion_answers(api):
    response = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8, temperature=0,
    )
    assert response.choices[0].finish_reason in ("length", "stop")
    assert response.usage.completion_tokens >= 1


def test_stop_strings_cut_the_text_exactly(api, gpu_checkpoint):
    """A stop string that is a whole token's text in the middle of the unstopped answer."""
    tokenizer = AutoTokenizer.from_pretrained(gpu_checkpoint)
    prompt = random_prompt(16, seed=21)
    whole = complete(api, prompt, 32)
    tokens, text = token_ids(whole), whole.text
    offsets = [len(tokenizer.decode(tokens[:n])) for n in range(len(tokens) + 1)]
    stop = next(
        piece for n in range(8, len(tokens))
        if (piece := text[offsets[n] : offsets[n + 1]]).strip() and "\ufffd" not in piece
    )
    expected, stopped = stopped_text(text, [stop])
    assert stopped
    cut = complete(api, prompt, 32, stop=[stop])
    assert (cut.text, cut.finish_reason) == (expected, "stop")


def test_same_seed_samples_the_same_tokens(api):
    prompt = random_prompt(10, seed=11)

    def sample():
        return token_ids(api.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=1.0, seed=1234,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ).choices[0])

    assert sample() == sample()


def test_min_p_1_samples_only_the_most_likely_tokens(api):
    """MAX 26.7's CPU sampling kernel ignores min_p, so the package cuts it on the CPU
    (`shims.min_p`); on the GPU MAX's kernel is left to apply it: at 1 a seeded draw at
    temperature 1 takes a most likely token at every step (one of a tie, which
    bfloat16 logits can hold), where without it some step takes another."""
    prompt = random_prompt(10, seed=12)

    def top_or_not(**options) -> list[bool]:
        logprobs = api.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, seed=1234, temperature=1.0,
            logprobs=1, extra_body={"ignore_eos": True, **options},
        ).choices[0].logprobs
        return [chosen == max(top.values())
                for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs,
                                       strict=True)]

    assert not all(top_or_not())
    assert all(top_or_not(min_p=1.0))


def bfloat16_tolerance(reference, prompt: list[int], tokens: list[int]) -> float:
    """Three times transformers' own bfloat16 deviation from float32 on these steps."""
    fp32 = reference_rows(reference, prompt, tokens)
    bf16 = reference_rows(reference, prompt, tokens, torch.bfloat16)
    steps = np.arange(len(tokens))
    return 3 * float(np.max(np.abs(bf16[steps, tokens] - fp32[steps, tokens])))


def test_logprobs_are_within_bfloat16s_reach_of_transformers(api, gpu_reference):
    prompt = random_prompt(30, seed=3)
    choice = complete(api, prompt, 8, logprobs=3)
    tokens = token_ids(choice)
    fp32 = reference_rows(gpu_reference, prompt, tokens)
    expected = fp32[np.arange(len(tokens)), tokens]
    tolerance = bfloat16_tolerance(gpu_reference, prompt, tokens)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, expected, atol=tolerance, rtol=0)
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)


def test_echo_returns_the_prompt_logprobs(api, gpu_reference):
    # One chunk: MAX 26.7 drops the logprobs of earlier chunks of a chunked prompt.
    prompt = random_prompt(60, seed=13)
    choice = complete(api, prompt, 1, echo=True, logprobs=1)
    reported = choice.logprobs.token_logprobs
    # OpenAI's shape: the first prompt token's entry is null (no token precedes it).
    assert len(reported) == len(prompt) + 1 and reported[0] is None
    first, rest = prompt[:1], prompt[1:]
    fp32 = reference_rows(gpu_reference, first, rest)
    expected = fp32[np.arange(len(rest)), rest]
    tolerance = bfloat16_tolerance(gpu_reference, first, rest)
    np.testing.assert_allclose(reported[1:-1], expected, atol=tolerance, rtol=0)


def test_a_repeated_prompt_hits_the_prefix_cache(api):
    prompt = random_prompt(230, seed=42)
    first, second = (
        api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, **GREEDY)
        for _ in range(2)
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert token_ids(first.choices[0]) == token_ids(second.choices[0])


def test_structured_output_follows_the_schema(api):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "A person as JSON"}],
        max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(prompt=list(range(1025))), "Prompt is too long"),
        (dict(prompt=[15496, 50257]), "token id 50257 at position 1 is outside"),
        (dict(prompt="Hi", top_p=7), ""),
    ],
    ids=["too-long", "out-of-vocab", "top-p-7"],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(api, served, body, message):
    response = httpx.post(
        f"{served.url}/v1/completions", json={"model": MODEL_NAME, "max_tokens": 4, **body},
        timeout=60,
    )
    assert 400 <= response.status_code < 500, response.text
    assert message in response.text
    assert len(token_ids(complete(api, random_prompt(12, seed=99), 4))) == 4


def test_max_generate_runs_on_the_gpu(gpu_checkpoint):
    result = subprocess.run(
        [max_executable(), "generate",
         "--custom-architectures", "gpt2_max", "--model", str(gpu_checkpoint),
         "--prompt", "Hello, my name is", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=900, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-4000:]
