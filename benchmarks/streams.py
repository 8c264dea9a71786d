"""Streamed completions, read the same lean way from every server the benchmarks time.

A benchmark's client runs on the cores the server under test uses, so what the client
spends on each streamed chunk comes out of the server's step. The OpenAI SDK builds a
pydantic object per chunk; here every server's stream (`max serve` and `llama-server`
alike) is read as server-sent-event lines, one `json.loads` each, so no server pays more
for its client than another.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.server import MODEL_NAME

MAX_GREEDY = {
    **{key: value for key, value in GREEDY.items() if key != "extra_body"},
    **GREEDY["extra_body"],
}
"""`GREEDY` as a request body rather than OpenAI-client arguments."""
TIMEOUT = httpx.Timeout(600.0, connect=10.0)
"""As long as the OpenAI client waits for a response; a server that stops answering
fails the benchmark instead of hanging it."""


def client() -> httpx.AsyncClient:
    """The client every stream of a benchmark is read with."""
    return httpx.AsyncClient(timeout=TIMEOUT)


async def stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any],
    token_ids: Callable[[dict[str, Any]], list[int]],
    on_first_token: Callable[[], object] | None = None,
) -> dict:
    """POSTs `body` to `url` and reads its event stream: the tokens (`token_ids` of each
    event), each token's arrival time, the wall time and the last event. `on_first_token`
    is called as the first token arrives.

    Raises:
        httpx.HTTPStatusError: the server refused the request (its answer included).
        RuntimeError: the stream carried an error event.
    """
    start = time.perf_counter()
    arrivals: list[float] = []
    out: list[int] = []
    event: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as response:
        if response.is_error:
            await response.aread()
            raise httpx.HTTPStatusError(
                f"{response.status_code} from {url}: {response.text}",
                request=response.request, response=response,
            )
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url} streamed an error: {event['error']}")
            new = token_ids(event)
            if not new:
                continue
            out += new
            arrivals += [time.perf_counter() - start] * len(new)
            if on_first_token is not None and len(out) == len(new):
                on_first_token()
    return {"tokens": out, "arrivals": arrivals, "wall": time.perf_counter() - start,
            "last": event}


def _all_of(result: dict, generated: int, max_tokens: int, url: str) -> dict:
    """`result`, checked to have `generated` the `max_tokens` tokens a request that
    ignores the end of text must: a stream cut short would otherwise read as a fast one."""
    if generated != max_tokens:
        raise RuntimeError(f"{url} generated {generated} of {max_tokens} tokens")
    return result


def completion_token_ids(event: dict[str, Any]) -> list[int]:
    choices = event.get("choices")
    return (choices[0].get("token_ids") or []) if choices else []


async def max_completion(
    client: httpx.AsyncClient, base_url: str, tokens: list[int], max_tokens: int,
    on_first_token: Callable[[], object] | None = None,
) -> dict:
    """One streamed greedy completion from `max serve` (OpenAI's completions route)."""
    body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "stream": True,
            **MAX_GREEDY}
    url = f"{base_url}/v1/completions"
    result = await stream(client, url, body, completion_token_ids, on_first_token)
    return _all_of(result, len(result["tokens"]), max_tokens, url)


async def llama_completion(
    client: httpx.AsyncClient, base_url: str, tokens: list[int], max_tokens: int,
) -> dict:
    """One streamed greedy completion of `max_tokens` tokens from `llama-server`'s own
    route, which streams token ids. It streams a token's id with its text, so one whose
    text is an unfinished UTF-8 sequence at the end is never streamed; the count of
    tokens generated is its last event's `tokens_predicted`."""
    body = {"prompt": tokens, "n_predict": max_tokens, "stream": True, "top_k": 1,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
    url = f"{base_url}/completion"
    result = await stream(client, url, body, lambda event: event.get("tokens") or [])
    return _all_of(result, result["last"].get("tokens_predicted", -1), max_tokens, url)


async def gather(
    completion: Callable[[httpx.AsyncClient, str, list[int], int], Awaitable[dict]],
    base_url: str, prompts: list[list[int]], max_tokens: int,
) -> list[dict]:
    """`prompts` sent at once through `completion` (`max_completion`, `llama_completion`),
    each streamed on one client: per request its tokens, their arrival times and its
    wall time."""
    async with client() as shared:
        return list(await asyncio.gather(
            *(completion(shared, base_url, p, max_tokens) for p in prompts)
        ))
