"""Two hundred requests of every kind a served GPT-2 gets, for a server on the GPU.

The kinds: sequential prompts up to the window, 32 concurrent at a time, streamed and
not, a shared 384-token prefix (three full KV pages: prefix-cache hits), and seeded
sampling sent twice per seed. Greedy answers in bfloat16 depend on what else is in the
batch, so the checks are the ones that hold in any batch: every request answered 200
with the tokens it asked for (`ignore_eos`), and each seed's two answers equal.
`benchmarks/gpu_probe.py` runs it against the servers it probes; the tier's test
(`test_serve_gpt2_small.py`) asserts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from gpt2_max.testing.reference import random_prompt
from gpt2_max.testing.server import MODEL_NAME

WINDOW = 1024
"""gpt2-small's `n_positions`."""


async def complete(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
    stream: bool = False, **extra: Any,
) -> dict[str, Any]:
    """One completion: its HTTP status (or `stream-error`), text, and token count (from
    `usage` when not streamed, the count of `token_ids` streamed otherwise)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream, **extra}
    began = time.perf_counter()
    if not stream:
        response = await client.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            return {"status": response.status_code, "body": response.text[:300]}
        answer = response.json()
        return {"status": 200, "tokens": answer["usage"]["completion_tokens"],
                "text": answer["choices"][0]["text"], "s": time.perf_counter() - began}
    text, tokens = "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "body": response.text[:300]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return {"status": "stream-error", "body": str(event)[:300]}
            choice = event["choices"][0]
            text += choice["text"]
            tokens += len(choice.get("token_ids") or [])
    return {"status": 200, "tokens": tokens, "text": text, "s": time.perf_counter() - began}


async def two_hundred_requests(url: str) -> dict[str, Any]:
    """The workload; returns how many requests were sent, those that failed (a status
    other than 200, or fewer or more tokens than asked) and how many seeds repeated."""
    asked: list[int] = []
    answers: list[dict[str, Any]] = []
    seeded: list[str | None] = []

    async def send(prompt: list[int], max_tokens: int, stream: bool, **extra: Any) -> None:
        asked.append(max_tokens)
        answers.append({})  # keeps the order of `asked` under concurrency
        slot = len(answers) - 1
        answers[slot] = await complete(client, url, prompt, max_tokens, stream, **extra)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        for i in range(40):  # one at a time, prompts up to the window
            length = (1, 16, 200, 511, 900, 1000)[i % 6]
            await send(random_prompt(length, 300 + i), min(24, WINDOW - length), i % 2 == 0)
        for round_ in range(4):  # 32 at once, prompts of 8..969 tokens
            await asyncio.gather(*(
                send(random_prompt(8 + 31 * j, 400 + 32 * round_ + j), 32, j % 2 == 0)
                for j in range(32)
            ))
        prefix = random_prompt(384, 7)
        for i in range(16):  # the same three full pages first: prefix-cache hits
            await send(prefix + random_prompt(5, 500 + i), 16, i % 2 == 1)
        for i in range(16):  # each seed twice
            await send(random_prompt(12, 600 + i // 2), 24, False,
                       temperature=1.0, top_k=50, seed=1234 + i // 2)
            seeded.append(answers[-1].get("text"))
    failed = [
        {"index": i, "asked": n, **answer}
        for i, (n, answer) in enumerate(zip(asked, answers, strict=True))
        if answer.get("status") != 200 or answer.get("tokens") != n
    ]
    repeated = sum(seeded[2 * k] == seeded[2 * k + 1] for k in range(len(seeded) // 2))
    return {"requests": len(answers), "failed": failed, "seeds_repeated": repeated,
            "seeds": len(seeded) // 2}
