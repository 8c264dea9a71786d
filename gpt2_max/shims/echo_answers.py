"""Completions' `echo` answered as OpenAI's API and vLLM answer it: the prompt's text
before the completion's, and a log-probability entry for every prompt token, the first
`null`.

MAX 26.7's completions route takes `echo` only as a request for the prompt's
log-probabilities (served with `--enable-echo`): its text is the completion's alone, and
its `token_logprobs` and `top_logprobs` start at the prompt's second token, which no
entry marks: L - 1 + k entries for a prompt of L tokens and k new ones, where OpenAI's
answer has L + k. A client that reads the prompt's entries by position, as
lm-evaluation-harness scores a continuation (`token_logprobs[ctxlen:-1]`), read each one
a token off. This patch of the route's answers, whole and streamed (in a stream's first
chunk), puts the prompt's text first and a `null` entry before the log-probabilities;
with the text echoed, `echo` without `logprobs` is served too. The `tokens` and
`text_offset` lists stay `null`, as MAX answers every completion.

Installed by `shims.install`; it acts in the API process.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from max.serve.router import openai_routes


def prompt_text(pipeline: Any, request: Any) -> str:
    """The text of `request`'s prompt: as sent, or its token ids decoded (special tokens
    kept: they are the prompt's)."""
    if isinstance(request.prompt, str):
        return request.prompt
    return pipeline.tokenizer.delegate.decode(list(request.prompt))


ENTRIES = ("token_logprobs", "top_logprobs")
"""A completion's log-probability lists, one entry a token."""


def echoed(choice: Any, text: str) -> None:
    """Puts `text` before a completion choice's text and a `null` entry before each of
    its log-probability lists that has entries (MAX answers a request without
    `logprobs` with empty ones): the route's model of a choice, or a streamed one's JSON."""
    if isinstance(choice, dict):
        choice["text"] = text + (choice.get("text") or "")
        logprobs = choice.get("logprobs") or {}
        for name in ENTRIES:
            if logprobs.get(name):
                logprobs[name] = [None, *logprobs[name]]
        return
    choice.text = text + (choice.text or "")
    for name in ENTRIES:
        if choice.logprobs is not None and (entries := getattr(choice.logprobs, name)):
            setattr(choice.logprobs, name, [None, *entries])


def echoes_complete(complete: Callable[..., Any]) -> Callable[..., Any]:
    """`complete` (the route's whole answer to a body's prompts, one choice each), each
    choice of an echoing request `echoed`."""
    @functools.wraps(complete)
    async def answer(self: Any, requests: list[Any]) -> Any:
        response = await complete(self, requests)
        for choice, request in zip(response.choices, requests, strict=True):
            if request.echo:
                echoed(choice, prompt_text(self.pipeline, request))
        return response

    answer.echoes = True  # type: ignore[attr-defined]
    return answer


def echoes_stream(stream: Callable[..., Any]) -> Callable[..., Any]:
    """`stream` (the route's streamed answer: its chunks' JSON, or an error response),
    the first chunk holding a choice `echoed` where the request echoes."""
    @functools.wraps(stream)
    async def answer(self: Any, request: Any) -> Any:
        chunks = await stream(self, request)
        if not request.echo or not isinstance(chunks, AsyncIterator):
            return chunks
        return _echo_first(chunks, prompt_text(self.pipeline, request))

    return answer


async def _echo_first(chunks: AsyncIterator[Any], text: str) -> AsyncIterator[Any]:
    pending = True
    async for chunk in chunks:
        if pending and isinstance(chunk, str) and chunk.startswith("{"):  # not "[DONE]"
            payload = json.loads(chunk)
            if payload.get("choices"):
                echoed(payload["choices"][0], text)
                chunk, pending = json.dumps(payload, ensure_ascii=False,
                                            separators=(",", ":")), False
        yield chunk


def install() -> None:
    """Wraps the completions route's whole and streamed answers (once)."""
    generator = openai_routes.OpenAICompletionResponseGenerator
    if getattr(generator.complete, "echoes", False):
        return
    generator.complete = echoes_complete(generator.complete)  # type: ignore[method-assign]
    generator.stream = echoes_stream(generator.stream)  # type: ignore[method-assign]
