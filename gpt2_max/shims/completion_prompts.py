"""Completions bodies MAX 26.7's route answers 500, answered 400 with their cause.

`/v1/completions` turns `prompt` into one request per prompt and then reads the
first request without checking there is one (`"prompt": []`), and refuses a
streamed body of several prompts by raising `NotImplementedError`, which no
handler catches (`max/serve/router/openai_routes.py`, `openai_create_completion`).
Both are the client's mistake. This module wraps the route's body parser
(`_parse_openai_request_body`, which the route looks up by name as it runs) so
such a completions body is refused there with `InputError`, which the route
answers 400 with its message. Every other body, and every other route, is
parsed as before.

Installed by `shims.install`; it acts in the API process.
"""

from __future__ import annotations

from typing import Any

from max.pipelines.context.exceptions import InputError
from max.serve.router import openai_routes


def check(body: Any) -> None:
    """Raises `InputError` for a completions body with no prompt, or with several
    prompts and `stream` (OpenAI streams one prompt a request)."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise InputError("prompt is empty: give a string, or a list of token ids or strings.")
        if body.stream and isinstance(prompt[0], str | list) and len(prompt) > 1:
            raise InputError(
                f"stream answers one prompt, and this request has {len(prompt)}: "
                "send each prompt in a request of its own, or leave stream off."
            )


def install() -> None:
    """Wraps the route's body parser with `check` for completions bodies (once)."""
    original = openai_routes._parse_openai_request_body
    if getattr(original, "checks_prompts", False):
        return

    async def parse(request: Any, request_id: str, model_cls: type) -> Any:
        body = await original(request, request_id, model_cls)
        if model_cls is openai_routes.CreateCompletionRequest:
            check(body)
        return body

    parse.checks_prompts = True  # type: ignore[attr-defined]
    openai_routes._parse_openai_request_body = parse
