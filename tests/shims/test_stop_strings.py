"""`cut_at_stops` on MAX's token-chunk stream, without a server."""

import asyncio
import random
from types import SimpleNamespace

import pytest
from max.pipelines.context import GenerationStatus
from max.serve.pipelines.incremental_detokenizer import create_buffered_detokenizer
from max.serve.pipelines.llm import TokenGeneratorOutput
from transformers import AutoTokenizer

from gpt2_max.shims.stop_strings import cut_at_stops, sent, up_to
from gpt2_max.stop import StopScanner
from gpt2_max.testing.reference import stopped_text
from gpt2_max.tokenizer import TOKENIZER_DIR

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


def cut_ids(
    groups: list[list[int]], stops: list[str], alphabet: str, min_tokens: int = 0,
) -> tuple[list[int], int, str]:
    """Token ids, token count and text the routes see when the worker sends `groups`."""
    decode = lambda ids: "".join(alphabet[i] for i in ids)  # noqa: E731

    async def source():
        for i, ids in enumerate(groups):
            status = GenerationStatus.MAXIMUM_LENGTH if i == len(groups) - 1 else (
                GenerationStatus.ACTIVE)
            yield TokenGeneratorOutput(status=status, decoded_tokens=decode(ids) or None,
                                       token_count=len(ids), token_ids=list(ids))

    async def run():
        cut = cut_at_stops(source(), StopScanner(stops), lambda: None, decode, min_tokens)
        return [c async for c in cut]

    out = asyncio.run(run())
    return (sum((c.token_ids for c in out), []), sum(c.token_count for c in out),
            "".join(c.decoded_tokens or "" for c in out))


def test_a_chunk_echoing_its_prompt_keeps_the_prompt_s_log_probabilities() -> None:
    """With echo, a chunk's log-probabilities are the prompt's then its tokens'; cut at
    a stop from the front, the prompt's were lost (2 kept of 6)."""
    chunk = TokenGeneratorOutput(
        status=GenerationStatus.ACTIVE, token_count=3, token_ids=[7, 8, 9],
        token_log_probabilities=[-1.0, -2.0, -3.0, -0.1, -0.2, -0.3],
        top_log_probabilities=[{i: ("t", -1.0)} for i in range(6)])
    cut = up_to(chunk, 2)
    assert (cut.token_count, cut.token_ids) == (2, [7, 8])
    assert cut.token_log_probabilities == [-1.0, -2.0, -3.0, -0.1, -0.2]
    assert len(cut.top_log_probabilities) == 5


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


def test_no_stop_ends_in_the_first_min_tokens_tokens() -> None:
    """As vLLM reads `min_tokens` beside `stop`: a stop string counts only where it ends
    past the first `min_tokens` tokens (it may begin before), whether the worker sends
    one token a chunk or several."""
    rng = random.Random(11)
    alphabet = "ab c"
    for _ in range(500):
        ids = [rng.randrange(len(alphabet)) for _ in range(16)]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 3))]
        least = rng.randint(0, 12)
        text = "".join(alphabet[i] for i in ids)  # a character a token
        ends = [(start + len(stop), -len(stop), start)
                for stop in stops for start in range(len(text))
                if text.startswith(stop, start) and start + len(stop) > least]
        end, _, start = min(ends, default=(len(ids), 0, len(text)))
        groups, at = [], 0
        while at < len(ids):
            size = rng.randint(1, 5)
            groups.append(ids[at:at + size])
            at += size
        want = (ids[:end], end, text[:start])
        assert cut_ids([[i] for i in ids], stops, alphabet, least) == want, (ids, stops, least)
        assert cut_ids(groups, stops, alphabet, least) == want, (groups, stops, least)


def served_ids(
    groups: list[list[int]], stops: list[str], min_tokens: int = 0,
) -> tuple[list[int], int, str]:
    """Ids, count and text the routes see when the worker sends GPT-2 tokens in `groups`,
    each chunk's text made by MAX's own buffered detokenizer (which holds back a token
    that ends inside a UTF-8 character), the stop's tokens found by the tokenizer's
    decode (which shows such a character as U+FFFD)."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    delegate = SimpleNamespace(delegate=tokenizer)

    async def source():
        detokenizer = create_buffered_detokenizer(delegate, [], skip_special_tokens=True)
        for i, ids in enumerate(groups):
            status = GenerationStatus.MAXIMUM_LENGTH if i == len(groups) - 1 else (
                GenerationStatus.ACTIVE)
            text = await detokenizer.decode(ids)
            yield TokenGeneratorOutput(status=status, decoded_tokens=text or None,
                                       token_count=len(ids), token_ids=list(ids))

    async def run():
        cut = cut_at_stops(source(), StopScanner(stops), lambda: None,
                           lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           min_tokens)
        return [c async for c in cut]

    out = asyncio.run(run())
    return (sum((c.token_ids for c in out), []), sum(c.token_count for c in out),
            "".join(c.decoded_tokens or "" for c in out))


@pytest.mark.parametrize("stop", ["age ", "age \u2014", "\u2014 two"])
def test_a_stop_completed_inside_an_unfinished_character_counts_the_same_in_every_mode(stop):
    """Issue 47's case: a token that is a space and the first byte of a three-byte
    character completes the stop "age " (its text, and so the stop, reaches the routes
    only with a later token); a stop that ends on that character completes two tokens
    later, at its last byte; one that starts inside it ends later still. One token a
    chunk, and the same tokens in chunks of several, give the ids and count of the rule:
    up to the token whose decoded text completes the stop."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    space_and_first_byte = tokenizer.convert_tokens_to_ids("\u0120\u00e2")  # " " + 0xE2
    rest_of_dash = [tokenizer.convert_tokens_to_ids(b) for b in ("\u0122", "\u0136")]  # 80 94
    ids = [*tokenizer.encode("Taselage"), space_and_first_byte, *rest_of_dash,
           *tokenizer.encode(" two COMMUN things")]
    assert tokenizer.decode(ids) == "Taselage \u2014 two COMMUN things"
    completes = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    want = (ids[:completes], completes)
    for size in range(1, len(ids) + 1):
        groups = [ids[at:at + size] for at in range(0, len(ids), size)]
        got_ids, count, text = served_ids(groups, [stop])
        assert (got_ids, count) == want, size
        assert text == "Taselage \u2014 two COMMUN things".split(stop)[0], size


@pytest.mark.parametrize("least", [4, 5])
def test_a_character_finished_past_min_tokens_is_past_it(least):
    """The 4th token is a space and the dash's first byte, the 6th its last: a stop on
    the dash ends at the 6th token, past `min_tokens` 4 or 5, and counts there; it was
    taken for text of the first tokens, and the answer ran to the second dash."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    dash = [tokenizer.convert_tokens_to_ids(t) for t in ("\u0120\u00e2", "\u0122", "\u0136")]
    ids = [*tokenizer.encode("Taselage"), *dash, *tokenizer.encode(" two COMMUN things"),
           *dash, *tokenizer.encode(" end")]
    assert tokenizer.decode(ids) == "Taselage \u2014 two COMMUN things \u2014 end"
    assert tokenizer.decode(ids[:len(tokenizer.encode("Taselage")) + 3]).endswith("\u2014")
    first = len(tokenizer.encode("Taselage")) + 3
    for size in range(1, len(ids) + 1):
        groups = [ids[at:at + size] for at in range(0, len(ids), size)]
        assert served_ids(groups, ["\u2014"], least) == (ids[:first], first, "Taselage "), size


def test_a_chunk_cut_to_no_text_keeps_its_log_probabilities_and_no_other_is_sent_empty():
    """MAX's streaming routes skip a textless chunk and send the last without its
    log-probabilities: one cut to no text goes out as "" where it has them."""
    def chunk(log_probabilities):
        return TokenGeneratorOutput(status=GenerationStatus.ACTIVE, decoded_tokens="ab",
                                    token_log_probabilities=log_probabilities)

    assert sent("", chunk([-1.5])) == ""
    assert sent("", chunk(None)) is None and sent("", chunk([])) is None
    assert sent("a", chunk(None)) == "a"

    async def run(log_probabilities):
        async def source():
            yield TokenGeneratorOutput(status=GenerationStatus.ACTIVE, decoded_tokens="x",
                                       token_log_probabilities=log_probabilities)
            yield TokenGeneratorOutput(status=GenerationStatus.ACTIVE, decoded_tokens="yz",
                                       token_log_probabilities=log_probabilities)
        return [c async for c in cut_at_stops(source(), StopScanner(["xy"]), lambda: None)]

    held, cut = asyncio.run(run([-0.5]))  # "x" held (it could begin the stop), "y" cut
    assert (held.decoded_tokens, cut.decoded_tokens) == ("", "")
    assert cut.token_log_probabilities == [-0.5]
    assert cut.status == GenerationStatus.END_OF_SEQUENCE
    held, cut = asyncio.run(run(None))
    assert (held.decoded_tokens, cut.decoded_tokens) == (None, None)
