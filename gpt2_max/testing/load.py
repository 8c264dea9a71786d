"""A bounded load generator for `max serve`, checked token for token against transformers.

Used by the package's serving tests and by `benchmarks/soak.py`. Every request is a
greedy completion of a token-id prompt, so its exact answer is known in advance:
the first `max_tokens` tokens of transformers' greedy continuation, cut at the
context window. Prompts repeat (several requests share one), which also keeps
the prefix cache busy and lets one reference continuation serve many requests.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
from openai import AsyncOpenAI
from transformers import GPT2LMHeadModel

from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.testing.reference import hf_greedy
from gpt2_max.testing.server import MODEL_NAME

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
"""openai-client arguments of a greedy request that answers with token ids."""


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    cancel_after_first_token: bool = False


@dataclass
class LoadReport:
    completed: dict[int, list[int]] = field(default_factory=dict)
    """Request index → the token ids it received (each index at most once)."""
    duplicated: list[int] = field(default_factory=list)
    cancelled: int = 0
    failed: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0


def plan_requests(
    count: int,
    n_positions: int,
    *,
    distinct_prompts: int,
    max_prompt: int,
    cancellations: int = 0,
    seed: int = 0,
) -> list[LoadRequest]:
    """`count` requests over `distinct_prompts` prompts of 1..`max_prompt` tokens.

    Half stream. Most ask for few tokens; one in ten asks for the whole rest of
    the window or more. The first `cancellations` streaming requests hang up
    after their first token.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_prompt + 1, distinct_prompts)
    prompts = [tuple(rng.integers(0, GPT2_VOCAB_SIZE, n).tolist()) for n in lengths]
    requests = []
    for i in range(count):
        prompt = prompts[i % distinct_prompts]
        room = n_positions - len(prompt)
        max_tokens = int(rng.integers(room, room + 64)) if i % 10 == 0 else int(
            rng.integers(1, min(room, 48) + 1)
        )
        stream = i % 2 == 1
        cancel = stream and cancellations > 0 and i // 2 < cancellations
        requests.append(LoadRequest(i, prompt, max_tokens, stream, cancel))
    return requests


def expected_tokens(
    model: GPT2LMHeadModel, requests: list[LoadRequest], n_positions: int
) -> dict[int, list[int]]:
    """Each request's exact answer, from one reference continuation per prompt."""
    longest: dict[tuple[int, ...], int] = {}
    for r in requests:
        want = min(r.max_tokens, n_positions - len(r.prompt))
        longest[r.prompt] = max(longest.get(r.prompt, 0), want)
    continuation = {
        prompt: hf_greedy(model, list(prompt), n)[0] for prompt, n in longest.items()
    }
    return {
        r.index: continuation[r.prompt][: min(r.max_tokens, n_positions - len(r.prompt))]
        for r in requests
    }


async def _one(api: AsyncOpenAI, request: LoadRequest, report: LoadReport) -> None:
    try:
        if request.stream:
            stream = await api.completions.create(
                model=MODEL_NAME, prompt=list(request.prompt), max_tokens=request.max_tokens,
                stream=True, **GREEDY,
            )
            tokens: list[int] = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
                    tokens += chunk.choices[0].model_extra["token_ids"]
                    if request.cancel_after_first_token:
                        await stream.close()
                        report.cancelled += 1
                        return
        else:
            response = await api.completions.create(
                model=MODEL_NAME, prompt=list(request.prompt), max_tokens=request.max_tokens,
                **GREEDY,
            )
            tokens = response.choices[0].model_extra["token_ids"]
    except Exception as error:  # noqa: BLE001 - every failure is reported, none raised
        report.failed[request.index] = f"{type(error).__name__}: {error}"
        return
    if request.index in report.completed:
        report.duplicated.append(request.index)
    report.completed[request.index] = tokens


async def _run(url: str, requests: list[LoadRequest], concurrency: int) -> LoadReport:
    report = LoadReport()
    slots = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as api:

        async def bounded(request: LoadRequest) -> None:
            async with slots:
                await _one(api, request, report)

        start = time.perf_counter()
        await asyncio.gather(*(bounded(r) for r in requests))
        report.wall_s = time.perf_counter() - start
    return report


def run_load(url: str, requests: list[LoadRequest], concurrency: int) -> LoadReport:
    """Sends `requests`, at most `concurrency` in flight, and reports what came back."""
    return asyncio.run(_run(url, requests, concurrency))

