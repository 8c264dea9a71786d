"""`cut_at_stops` on MAX's token-chunk stream, without a server."""

import asyncio
import random

import pytest
from max.pipelines.context import GenerationStatus
from max.serve.pipelines.llm import TokenGeneratorOutput

from gpt2_max.shims.stop_strings import cut_at_stops, needed
from gpt2_max.stop import StopScanner
from gpt2_max.testing.reference import stopped_text

pytestmark = pytest.mark.tier("unit")


async def chunks_of(pieces: list[str], last: GenerationStatus, read: list[str]):
    for i, piece in enumerate(pieces):
        read.append(piece)
        status = last if i == len(pieces) - 1 else GenerationStatus.ACTIVE
        yield TokenGeneratorOutput(status=status, decoded_tokens=piece or None)


def through_cut(pieces: list[str], stops: list[str]) -> tuple[str, GenerationStatus, int, int]:
    """Text and final status the routes see, chunks read from MAX, and cancellations."""
    read: list[str] = []
    cancelled = []

    async def run():
        source = chunks_of(pieces, GenerationStatus.MAXIMUM_LENGTH, read)
        cut = cut_at_stops(source, StopScanner(stops), lambda: cancelled.append(1))
        return [c async for c in cut]

    out = asyncio.run(run())
    return "".join(c.decoded_tokens or "" for c in out), out[-1].status, len(read), len(cancelled)


def test_chunks_are_cut_at_the_first_stop_and_nothing_after_it_is_read() -> None:
    rng = random.Random(3)
    for _ in range(500):
        pieces = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 3))) for _ in range(8)]
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 4))]
        want, stopped = stopped_text("".join(pieces), stops)
        text, status, read, cancelled = through_cut(pieces, stops)
        assert text == want, (pieces, stops)
        if stopped:
            assert status == GenerationStatus.END_OF_SEQUENCE
            complete = next(n for n in range(1, 9) if stopped_text("".join(pieces[:n]), stops)[1])
            assert read == complete
            assert cancelled == (complete < len(pieces))
        else:
            assert (status, read, cancelled) == (GenerationStatus.MAXIMUM_LENGTH, 8, 0)


def test_only_max_releases_that_need_it_are_patched() -> None:
    assert needed("26.7.0")
    assert not needed("26.8.0")


def cut_ids(groups: list[list[int]], stops: list[str], alphabet: str) -> tuple[list[int], int, str]:
    """Token ids, token count and text the routes see when the worker sends `groups`."""
    decode = lambda ids: "".join(alphabet[i] for i in ids)  # noqa: E731

    async def source():
        for i, ids in enumerate(groups):
            status = GenerationStatus.MAXIMUM_LENGTH if i == len(groups) - 1 else (
                GenerationStatus.ACTIVE)
            yield TokenGeneratorOutput(status=status, decoded_tokens=decode(ids) or None,
                                       token_count=len(ids), token_ids=list(ids))

    async def run():
        cut = cut_at_stops(source(), StopScanner(stops), lambda: None, decode)
        return [c async for c in cut]

    out = asyncio.run(run())
    return (sum((c.token_ids for c in out), []), sum(c.token_count for c in out),
            "".join(c.decoded_tokens or "" for c in out))


def test_a_chunk_of_several_tokens_keeps_those_up_to_the_stop() -> None:
    """Grouping the same tokens into chunks (as a decode burst does) changes nothing
    a client sees: ids, count and text are those of one token a chunk."""
    rng = random.Random(5)
    alphabet = ["a", "b", " ", "c", "ab", ""]
    for _ in range(500):
        ids = [rng.randrange(len(alphabet)) for _ in range(16)]
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 3))]
        groups, at = [], 0
        while at < len(ids):
            size = rng.randint(1, 8)
            groups.append(ids[at:at + size])
            at += size
        assert cut_ids(groups, stops, alphabet) == cut_ids([[i] for i in ids], stops, alphabet)
