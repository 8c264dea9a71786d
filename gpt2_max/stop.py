"""OpenAI `stop` semantics: the text ends just before the first stop string it contains.

Generation halts as soon as a stop string is complete, so "first" means the stop that
completes first (ending earliest; of two ending together, the longer one).

One rule, used by the server path and the in-process generator alike. A stream can only
release text that cannot turn out to be the start of a stop string once more text arrives,
so `StopScanner` holds back the longest tail that is a prefix of some stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def first_stop(text: str, stops: Sequence[str], since: int = 0) -> int | None:
    """Index in `text` where the first stop string to complete starts, or None; with
    `since`, of the stops completed by `text[since:]`, none having been before it."""
    found = [
        (i + len(s), i) for s in stops
        if s and (i := text.find(s, max(0, since - len(s) + 1))) >= 0
    ]
    return min(found)[1] if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the first stop string, and whether one was found."""
    index = first_stop(text, stops)
    return (text, False) if index is None else (text[:index], True)


def held_back(text: str, stop: str, most: int) -> int:
    """Length of the longest tail of `text`, at most `most` long, that `stop` could
    still complete (a proper prefix of it)."""
    for n in range(min(most, len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


@dataclass
class StopScanner:
    """Feeds text pieces in; releases only text that is certainly before any stop.

    Each feed looks only at what the piece can change, so a request's cost grows with
    the length of its text times its stops, where a rescan of the whole text at each
    piece grew with the square of that length: a stop completed now ends in the piece,
    and the tail a stop could still complete is at most the piece longer than the one
    before it (`held`), found by trying lengths from there down.
    """

    stops: Sequence[str]
    text: str = ""
    released: int = 0
    stopped: bool = field(default=False, init=False)
    held: list[int] = field(default_factory=list, init=False)
    """Per stop, the tail of `text` it could still complete."""

    def __post_init__(self) -> None:
        self.held = [0] * len(self.stops)

    def feed(self, piece: str, stops: bool = True) -> str:
        """Adds `piece`; returns the newly released text (all of it up to a stop, if one
        hit). With `stops` false no stop may end in `piece` (the tokens before a
        request's `min_tokens`), though one may begin there."""
        if self.stopped:
            return ""
        before, self.text = len(self.text), self.text + piece
        index = first_stop(self.text, self.stops, since=before) if stops else None
        if index is not None:
            self.stopped = True
            end = max(index, self.released)
        else:
            self.held = [
                held_back(self.text, stop, tail + len(piece))
                for stop, tail in zip(self.stops, self.held, strict=True)
            ]
            end = len(self.text) - max(self.held, default=0)
        out, self.released = self.text[self.released : end], max(end, self.released)
        return out

    def flush(self) -> str:
        """At the end of generation without a stop: whatever was held back."""
        if self.stopped:
            return ""
        out, self.released = self.text[self.released :], len(self.text)
        return out
