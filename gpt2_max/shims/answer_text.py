"""An answer's text, its own tokens' text under `max serve`, whatever its prompt ends in.

MAX's serving pipeline primes each request's detokenizer with the prompt's ids
(`create_buffered_detokenizer` in `serve/pipelines/llm.py`), and the `tokenizers`
library's `DecodeStream` primed with ids that end inside a UTF-8 character (a prompt
of token ids can) writes the prompt's whole text before the answer's first token's:
`[15496, 30325]` ("Hello" and an emoji's first bytes) answered `"Hello � wing..."`
where the answer is `" wing..."`. A stop string then matched inside the prompt's text
and cut the answer, and echo sent the prompt twice.

GPT-2's byte-level tokens decode alike whatever comes before them, but for a character
whose bytes a prompt starts and its answer finishes, so the prompt primes nothing the
answer needs. For gpt2-max's pipelines the detokenizer starts empty: the answer's text
is its own tokens' decode, as the in-process `Generator` and transformers' streamer
with `skip_prompt` give it (bytes that finish a prompt's character show as U+FFFD).

It acts only for gpt2-max's tokenizers, and only on the MAX releases `shims.release`
names (`shims.install`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from max.serve.pipelines import llm

_TOKENIZER_TYPES: list[type] = []
"""Tokenizer types whose requests' detokenizers start empty (one per architecture that
installed the patch)."""


def answer_alone(create: Callable[..., Any]) -> Callable[..., Any]:
    """`create` (MAX's `create_buffered_detokenizer`), unprimed for gpt2-max's tokenizers."""

    @functools.wraps(create)
    def create_buffered_detokenizer(tokenizer: Any, prompt_token_ids: Any,
                                    *args: Any, **kwargs: Any) -> Any:
        if isinstance(tokenizer, tuple(_TOKENIZER_TYPES)):
            prompt_token_ids = []
        return create(tokenizer, prompt_token_ids, *args, **kwargs)

    create_buffered_detokenizer.answer_alone = True  # type: ignore[attr-defined]
    return create_buffered_detokenizer


def install(tokenizer_type: type) -> None:
    """Starts `tokenizer_type`'s requests' detokenizers empty; the first call patches the
    name the serving pipeline calls, every call adds its tokenizer type."""
    if tokenizer_type not in _TOKENIZER_TYPES:
        _TOKENIZER_TYPES.append(tokenizer_type)
    if not getattr(llm.create_buffered_detokenizer, "answer_alone", False):
        llm.create_buffered_detokenizer = answer_alone(llm.create_buffered_detokenizer)
