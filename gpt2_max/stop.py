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


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` where the first stop string to complete starts, or None."""
    found = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the first stop string, and whether one was found."""
    index = first_stop(text, stops)
    return (text, False) if index is None else (text[:index], True)


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that a stop string could still complete."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass
class StopScanner:
    """Feeds text pieces in; releases only text that is certainly before any stop."""

    stops: Sequence[str]
    text: str = ""
    released: int = 0
    stopped: bool = field(default=False, init=False)

    def feed(self, piece: str) -> str:
        """Adds `piece`; returns the newly released text (all of it up to a stop, if one hit)."""
        if self.stopped:
            return ""
        self.text += piece
        index = first_stop(self.text, self.stops)
        if index is not None:
            self.stopped = True
            end = max(index, self.released)
        else:
            end = len(self.text) - held_back(self.text, self.stops)
        out, self.released = self.text[self.released : end], max(end, self.released)
        return out

    def flush(self) -> str:
        """At the end of generation without a stop: whatever was held back."""
        if self.stopped:
            return ""
        out, self.released = self.text[self.released :], len(self.text)
        return out
