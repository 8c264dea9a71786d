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
sees do not depend on how the worker grouped them.

The rule for those ids: they end at the token whose text completes the stop,
each token's text decoded as the tokenizer decodes it (an unfinished UTF-8
character as U+FFFD). MAX's detokenizer holds back the text of a token that ends
inside a character until a later token finishes it, so a stop completed by such
a token would otherwise show in a later chunk than the token's own, a token or
more late, by how the worker happened to group the tokens. A chunk whose tokens
end inside a character (`ends_unfinished`) is therefore held and joined to the
next one (`joined`), whose tokens the rule then splits like any chunk of
several. Without a match the held-back text goes out with the last
chunk, whose finish reason stands.

It wraps only pipelines whose tokenizer is gpt2-max's, and only on the MAX
releases `shims.release` names; on any other release MAX's own handling is left
as it is.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import fields, replace
from typing import Any

from max.pipelines.context import GenerationStatus
from max.serve.pipelines.llm import TokenGeneratorOutput, TokenGeneratorPipeline

from ..stop import StopScanner, first_stop

UNFINISHED = "\ufffd"
"""What the tokenizer's decode shows for bytes that do not finish a character."""

CHARACTER_TOKENS = 4
"""Tokens a character can span at most (a UTF-8 character has 4 bytes at most)."""


def ends_unfinished(
    chunk: TokenGeneratorOutput, before: list[int],
    decode: Callable[[list[int]], str] | None,
) -> bool:
    """Whether `chunk`'s last token may end inside a character, the tokens `before` it
    given: it has no text yet, or (with `decode`) its tokens decode to an unfinished
    character at the end."""
    if not chunk.decoded_tokens:
        return True
    if decode is None or not chunk.token_ids:
        return False
    return decode(before[-CHARACTER_TOKENS:] + chunk.token_ids).endswith(UNFINISHED)


def finished(ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """How many characters `ids` finish: their text but an unfinished character at its
    end, which the token that finishes it writes."""
    return len(decode(ids).rstrip(UNFINISHED))


def tokens_to_stop(
    before: list[int], ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str],
    free: int = 0,
) -> int:
    """How many of a chunk's `ids` it takes, after the tokens `before` it, for the
    text to hold a stop string that ends past its first `free` tokens (all of them
    when no shorter run does)."""
    since = finished(before + ids[:free], decode)
    for n in range(free + 1, len(ids)):
        if first_stop(decode(before + ids[:n]), stops, since) is not None:
            return n
    return len(ids)


def stop_free_chars(
    before: list[int], ids: list[int], free: int, piece: str,
    decode: Callable[[list[int]], str] | None,
) -> int:
    """How much of a chunk's text `piece` its first `free` tokens `ids` (after `before`)
    wrote: none, all, or (with `decode`) the characters they finish (a character a
    later token finishes is that token's)."""
    if free <= 0 or not ids:
        return 0
    if free >= len(ids) or decode is None:
        return len(piece) if free >= len(ids) else 0
    wrote = finished(before + ids[:free], decode) - len(decode(before))
    return min(max(wrote, 0), len(piece))


PER_TOKEN = ("token_ids", "token_log_probabilities", "top_log_probabilities", "sampled_tokens")
"""A chunk's fields that hold one entry per token."""

TEXT = ("decoded_tokens", "decoded_reasoning_tokens")
"""A chunk's fields of decoded text."""


def up_to(chunk: TokenGeneratorOutput, n: int) -> TokenGeneratorOutput:
    """`chunk` holding only its first `n` tokens' ids, count and log-probabilities: its
    last `token_count - n` entries of each dropped. A chunk echoing its prompt holds a
    log-probability for each prompt token before its own tokens' (cut from the front,
    the echo was lost)."""
    dropped = chunk.token_count - n
    return replace(chunk, token_count=n, **{
        name: value[:len(value) - dropped]
        for name in PER_TOKEN if (value := getattr(chunk, name)) is not None
    })


def joined(first: TokenGeneratorOutput, then: TokenGeneratorOutput) -> TokenGeneratorOutput:
    """One chunk of `first`'s tokens followed by `then`'s: per-token lists and texts
    joined, counts added, and any other field `then`'s where it has one (its status)."""
    merged: dict[str, Any] = {}
    for field in fields(then):
        a, b = getattr(first, field.name), getattr(then, field.name)
        if field.name in PER_TOKEN:
            merged[field.name] = None if a is None and b is None else [*(a or []), *(b or [])]
        elif field.name in TEXT:
            merged[field.name] = (a or "") + (b or "") or None
        elif field.name == "token_count":
            merged[field.name] = a + b
        else:
            merged[field.name] = a if b is None else b
    return replace(then, **merged)


def sent(text: str, chunk: TokenGeneratorOutput) -> str | None:
    """A chunk's text as the routes are to read it. MAX's streaming routes skip a
    textless chunk, or send the last without its log-probabilities (its token ids they
    carry on), so a chunk whose text is all held back or cut goes out as text "" where
    it has log-probabilities, and as none (no empty event) where it has not."""
    return text or ("" if chunk.token_log_probabilities else None)


async def cut_at_stops(
    chunks: AsyncGenerator[TokenGeneratorOutput, None],
    scanner: StopScanner,
    stop_generating: Callable[[], None],
    decode: Callable[[list[int]], str] | None = None,
    min_tokens: int = 0,
) -> AsyncGenerator[TokenGeneratorOutput, None]:
    """`chunks` with their text cut before the first stop string, ending at it.

    `decode` (token ids to text) finds the token that completes the stop in a
    chunk of several; without it such a chunk keeps all its tokens. No stop ends
    in the first `min_tokens` tokens (a request's `min_tokens`, as vLLM reads it: MAX
    keeps the model from ending before them, and a stop string did).
    """
    seen: list[int] = []
    held: TokenGeneratorOutput | None = None  # tokens whose text MAX still buffers
    try:
        async for chunk in chunks:
            if held is not None:
                chunk, held = joined(held, chunk), None
            if not chunk.status.is_done and ends_unfinished(chunk, seen, decode):
                held = chunk
                continue
            piece, ids = chunk.decoded_tokens or "", chunk.token_ids or []
            free = max(0, min_tokens - len(seen))
            split = stop_free_chars(seen, ids, free, piece, decode)
            text = scanner.feed(piece[:split], stops=False) if split else ""
            text += scanner.feed(piece[split:])
            if scanner.stopped:
                if not chunk.status.is_done:
                    stop_generating()
                if decode is not None and chunk.token_count == len(ids) > 1:
                    chunk = up_to(chunk, tokens_to_stop(seen, ids, scanner.stops, decode, free))
                yield replace(chunk, decoded_tokens=sent(text, chunk),
                              status=GenerationStatus.END_OF_SEQUENCE)
                return
            seen += chunk.token_ids or []
            if chunk.status.is_done:
                text += scanner.flush()
            yield replace(chunk, decoded_tokens=sent(text, chunk))
        if held is not None:  # the source ended without a finished chunk
            yield held
    finally:
        await chunks.aclose()


_TOKENIZER_TYPES: list[type] = []
"""Tokenizer types whose requests' stop strings are cut here (one per architecture
that installed the patch; a process may register several)."""


def install(tokenizer_type: type) -> None:
    """Routes stop strings of requests to `tokenizer_type`'s pipelines through `cut_at_stops`.

    The first call patches `TokenGeneratorPipeline.next_token_chunk`; every call
    adds its tokenizer type.
    """
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
            request.sampling_params.min_new_tokens,
        )

    next_token_chunk.cuts_at_stops = True  # type: ignore[attr-defined]
    TokenGeneratorPipeline.next_token_chunk = next_token_chunk  # type: ignore[method-assign]
