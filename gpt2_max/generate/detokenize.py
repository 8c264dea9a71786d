"""Text pieces from a growing token list, never splitting a UTF-8 character.

GPT-2 tokens are byte sequences, so one character can span tokens; decoding a
partial character yields U+FFFD at the end. A piece is released only when the
decoded tail ends cleanly, and the next piece is decoded from there on, so each
token is decoded a bounded number of times instead of the whole text every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalText:
    decode: Callable[[Sequence[int]], str]
    released_tokens: int = 0

    def feed(self, tokens: Sequence[int]) -> str:
        """The text that `tokens` (the whole sequence so far) adds and that is final."""
        text = self.decode(tokens[self.released_tokens :])
        if text.endswith(REPLACEMENT):
            return ""
        self.released_tokens = len(tokens)
        return text

    def flush(self, tokens: Sequence[int]) -> str:
        """At the end: everything not yet released, a lone partial character included."""
        text = self.decode(tokens[self.released_tokens :])
        self.released_tokens = len(tokens)
        return text
