"""What a request yields: its `Completion`, and the in-flight `Row` it is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from max.pipelines.context import GenerationStatus, TextContext

from ..stop import StopScanner
from .constrained import GrammarMask
from .detokenize import IncrementalText
from .xgrammar_mask import XgrammarMask

Mask = GrammarMask | XgrammarMask
"""A row's grammar state, from either engine."""

FINISH_REASONS = {
    GenerationStatus.END_OF_SEQUENCE: "stop",
    GenerationStatus.MAXIMUM_LENGTH: "length",
}
"""MAX's reason a row ended, in OpenAI's words."""


@dataclass
class Completion:
    """One generated continuation."""

    text: str
    """The decoded new tokens, cut before the first stop string."""
    token_ids: list[int]
    """Every new token, the one that completed a stop string or EOS included."""
    finish_reason: str
    """"stop" (EOS, a stop token or string, or a complete grammar) or "length"."""
    prompt_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV entries came from the prefix cache instead of a prefill."""
    steps: int = 0
    """Model steps that sampled a token for this request."""
    forced_tokens: int = 0
    """Tokens a grammar forced and that ran inside another step (steps saved)."""
    logprobs: list[float | None] | None = None
    """Log-probability of each new token; None for tokens a grammar forced."""
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for lp in self.logprobs or () if lp is not None)


@dataclass
class Row:
    """One request in flight: its context and what has been made of its tokens."""

    context: TextContext
    stops: StopScanner
    text: IncrementalText
    mask: Mask | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    steps: int = 0
    pending_forced: int = 0
    finish_reason: str | None = None

    def completion(self) -> Completion:
        return Completion(
            text=self.stops.text[: self.stops.released],
            token_ids=self.tokens,
            finish_reason=self.finish_reason or "length",
            prompt_tokens=self.context.tokens.prompt_length,
            cached_tokens=self.context.cached_prefix_length or 0,
            steps=self.steps,
            forced_tokens=self.mask.forced if self.mask else 0,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )
