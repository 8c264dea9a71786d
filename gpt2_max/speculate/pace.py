"""How many tokens to draft a round, or none: the rule that keeps drafting where it pays.

A round of `k` drafted tokens costs `k` draft steps and one checking step, and makes
`1 + a` tokens a row, where `a` counts the drafted tokens kept. If each drafted token
is kept with probability `alpha` once the ones before it were, a round makes
`(1 - alpha^(k+1)) / (1 - alpha)` tokens on average. `Pace` measures `alpha` (kept
tokens over the drafted tokens the model judged, a judgement stopping at the first
refusal) and the two steps' times, each a moving average, and picks the `k` up to
the setting's that makes the most tokens a second; `k = 0`, one plain step a token,
when no round beats it (a plain step costs about what a checking step does: both read
every weight once). While drafting is off, one pass in `PROBE_EVERY` drafts anyway,
so a change in how well the draft guesses is seen. `GPT2_MAX_DRAFT_PACE=0` drafts
the most every round (for tests and benchmarks of a fixed length).
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP = 0.9
"""Weight of the past in each moving average, a round at a time."""

PROBE_EVERY = 32
"""Passes between rounds drafted anyway while drafting is off."""


def average(past: float | None, new: float) -> float:
    """The moving average `past` (None before the first) with `new` added."""
    return new if past is None else KEEP * past + (1 - KEEP) * new


def tokens_a_round(alpha: float, k: int) -> float:
    """Tokens a row makes on average in a round of `k` drafted tokens."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Pace:
    """Moving averages of what rounds cost and keep (see the module doc)."""

    most: int
    """The setting: the most tokens a round drafts."""
    steady: bool = False
    """Draft `most` every round, whatever it pays (`GPT2_MAX_DRAFT_PACE=0`)."""
    judged: float = 0.0
    kept: float = 0.0
    draft_s: float | None = None
    """One draft step's seconds."""
    check_s: float | None = None
    """One checking step's seconds."""
    passes_off: int = 0

    @property
    def alpha(self) -> float:
        return self.kept / self.judged if self.judged else 1.0

    def tokens(self) -> int:
        """How many tokens the next round drafts (0: none, a plain step)."""
        if self.steady or self.draft_s is None or self.check_s is None:
            return self.most
        rate = [tokens_a_round(self.alpha, k) / (k * self.draft_s + self.check_s)
                for k in range(self.most + 1)]
        best = max(range(self.most + 1), key=rate.__getitem__)
        if best:
            self.passes_off = 0
            return best
        self.passes_off += 1
        return self.most if self.passes_off % PROBE_EVERY == 0 else 0

    def note(self, k: int, kept: list[int], draft_s: float, check_s: float) -> None:
        """A round of `k` drafted tokens a row: how many each row kept, and the seconds
        of one draft step and of the checking step."""
        judged = sum(min(n + 1, k) for n in kept)
        self.judged = KEEP * self.judged + judged
        self.kept = KEEP * self.kept + sum(kept)
        self.draft_s = average(self.draft_s, draft_s)
        self.check_s = average(self.check_s, check_s)
