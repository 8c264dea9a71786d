"""Exact `stop` strings through `max serve` on MAX versions whose serving layer gets them wrong.

MAX 26.7 matches stop strings in the API process, chunk by chunk, and cuts the
text in only some routes: plain completions keep the stop text, streams send
it, a token produced after the match is appended, and a stop that drops out of
the matcher's trimmed buffer leaves the last chunk ACTIVE, which completions
answer with 400. Every completions and chat route, streamed or not, reads one
generator, `TokenGeneratorPipeline.next_token_chunk`; so this module takes the
stop strings off the request before MAX sees them and applies
`gpt2_max.stop.StopScanner` to the chunks that generator yields: text that
could still begin a stop is held back, the chunk that completes one is cut
before it and ends the response as END_OF_SEQUENCE (finish_reason "stop"),
and the model worker is told to stop generating. A chunk of several tokens (a
decode burst, forced tokens) keeps its tokens up to the one that completes the
stop, as one token a chunk would have: the ids and the token count a client
sees do not depend on how the worker grouped them. Without a match the held-back
text goes out with the last chunk, whose finish reason stands.

It wraps only pipelines whose tokenizer is gpt2-max's, and only on the MAX
releases in `NEEDED_FOR`; on any other release MAX's own handling is left as
it is.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any

from max.pipelines.context import GenerationStatus
from max.serve.pipelines.llm import TokenGeneratorOutput, TokenGeneratorPipeline

from ..stop import StopScanner, first_stop

NEEDED_FOR = ("26.7.",)
"""MAX releases (version prefixes) whose serving layer does not cut at stop strings exactly."""


def needed(max_version: str | None = None) -> bool:
    """Whether this MAX release needs the stop strings handled here."""
    return (max_version or importlib.metadata.version("max")).startswith(NEEDED_FOR)


def tokens_to_stop(
    before: list[int], ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str]
) -> int:
    """How many of a chunk's `ids` it takes, after the tokens `before` it, for the
    text to hold a stop string (all of them when no shorter run does)."""
    for n in range(1, len(ids)):
        if first_stop(decode(before + ids[:n]), stops) is not None:
            return n
    return len(ids)


def up_to(chunk: TokenGeneratorOutput, n: int) -> TokenGeneratorOutput:
    """`chunk` holding only its first `n` tokens' ids, count and log-probabilities."""
    lists = ("token_ids", "token_log_probabilities", "top_log_probabilities", "sampled_tokens")
    return replace(chunk, token_count=n, **{
        name: value[:n] for name in lists if (value := getattr(chunk, name)) is not None
    })


async def cut_at_stops(
    chunks: AsyncGenerator[TokenGeneratorOutput, None],
    scanner: StopScanner,
    stop_generating: Callable[[], None],
    decode: Callable[[list[int]], str] | None = None,
) -> AsyncGenerator[TokenGeneratorOutput, None]:
    """`chunks` with their text cut before the first stop string, ending at it.

    `decode` (token ids to text) finds the token that completes the stop in a
    chunk of several; without it such a chunk keeps all its tokens.
    """
    seen: list[int] = []
    try:
        async for chunk in chunks:
            text = scanner.feed(chunk.decoded_tokens or "")
            if scanner.stopped:
                if not chunk.status.is_done:
                    stop_generating()
                ids = chunk.token_ids or []
                if decode is not None and chunk.token_count == len(ids) > 1:
                    chunk = up_to(chunk, tokens_to_stop(seen, ids, scanner.stops, decode))
                yield replace(
                    chunk, decoded_tokens=text or None, status=GenerationStatus.END_OF_SEQUENCE
                )
                return
            seen += chunk.token_ids or []
            if chunk.status.is_done:
                text += scanner.flush()
            yield replace(chunk, decoded_tokens=text or None)
    finally:
        await chunks.aclose()


_TOKENIZER_TYPES: list[type] = []
"""Tokenizer types whose requests' stop strings are cut here (one per architecture
that installed the patch; a process may register several)."""


def install(tokenizer_type: type) -> None:
    """Routes stop strings of requests to `tokenizer_type`'s pipelines through `cut_at_stops`.

    The first call patches `TokenGeneratorPipeline.next_token_chunk` (on the
    releases in `NEEDED_FOR`); every call adds its tokenizer type.
    """
    if not needed():
        return
    if tokenizer_type not in _TOKENIZER_TYPES:
        _TOKENIZER_TYPES.append(tokenizer_type)
    original = TokenGeneratorPipeline.next_token_chunk
    if getattr(original, "cuts_at_stops", False):
        return

    async def next_token_chunk(
        self: TokenGeneratorPipeline, request: Any, **kwargs: Any
    ) -> AsyncGenerator[TokenGeneratorOutput, None]:
        stops = request.sampling_params.stop
        if not stops or not isinstance(self.tokenizer, tuple(_TOKENIZER_TYPES)):
            return await original(self, request, **kwargs)
        request = replace(request, sampling_params=replace(request.sampling_params, stop=None))
        chunks = await original(self, request, **kwargs)
        delegate = self.tokenizer.delegate
        return cut_at_stops(
            chunks, StopScanner(stops), lambda: self.model_worker.cancel(request.request_id),
            lambda ids: delegate.decode(ids, skip_special_tokens=True),
        )

    next_token_chunk.cuts_at_stops = True  # type: ignore[attr-defined]
    TokenGeneratorPipeline.next_token_chunk = next_token_chunk  # type: ignore[method-assign]
