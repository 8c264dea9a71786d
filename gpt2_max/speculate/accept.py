"""Which of a draft's tokens the model keeps, and the token after them.

Greedy rows keep drafted tokens while each is the model's largest logit and add the
model's own choice at the first that is not (or after the last): exactly the
tokens one step at a time gives. Rows sampled at a temperature use rejection
sampling (Leviathan et al. 2023, Chen et al. 2023): drafted token `d`, drawn from
the draft's distribution `q`, is kept with probability `min(1, p(d) / q(d))` under
the model's distribution `p`; at the first refusal the next token is drawn from
`max(p - q, 0)`, renormalized, and after the last kept one from `p`. Each token then
has the model's distribution, whatever the draft proposed.

Every draw is a function of the row's seed key for that token (MAX's key for the
row's next token plus its offset, `shims.internals.row_seed`) and of its use, so
a seeded round repeats exactly. A position no round covers is drawn by the plain
sampler instead, another token from the same distribution, so a seeded request
repeats where its rounds fall the same way (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampler.plain_rows import uniform_draws

DRAFT, KEEP, NEXT = 0, 1, 2
"""The uses of a token's key: drawing the draft's token, deciding whether the model
keeps it, drawing the model's own token."""

_STREAM = 0xD6E8FEB86659FD93
"""Spreads one key's uses apart before `uniform_draws` mixes them (an odd constant)."""


def draw(key: int, use: int) -> float:
    """A uniform number in [0, 1) for token key `key` and `use`."""
    seed = (key + use * _STREAM) % 2**64
    return float(uniform_draws(np.array([seed], dtype=np.uint64))[0])


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) in float64 (a draw compares against its sums)."""
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    np.exp(z, out=z)
    return z / z.sum()


def pick(probabilities: np.ndarray, u: float) -> int:
    """The token whose running sum of `probabilities` first exceeds `u` times the
    total (the last where rounding leaves none)."""
    running = np.cumsum(probabilities)
    return min(int(np.searchsorted(running, u * running[-1], side="right")),
               len(probabilities) - 1)


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its tokens: greedy, or at `temperature` from the full softmax,
    with `key` the seed key of its next token."""

    greedy: bool
    temperature: float
    key: int

    def propose(self, draft_logits: np.ndarray, offset: int) -> tuple[int, np.ndarray | None]:
        """The draft's token at `offset` tokens past the row's next, and (sampled rows)
        the draft distribution it was drawn from."""
        if self.greedy:
            return int(np.argmax(draft_logits)), None
        q = softmax(draft_logits, self.temperature)
        return pick(q, draw(self.key + offset, DRAFT)), q

    def accept(self, logits: np.ndarray, drafted: list[int],
               proposals: list[np.ndarray | None]) -> list[int]:
        """The row's tokens from the model's `logits` (`[len(drafted) + 1, vocab]`: at
        each drafted position, then after the last): the drafted tokens it keeps, then
        one of its own."""
        kept: list[int] = []
        for offset, token in enumerate(drafted):
            if self.greedy:
                best = int(np.argmax(logits[offset]))
                if best != token:
                    return [*kept, best]
            else:
                p = softmax(logits[offset], self.temperature)
                q = proposals[offset]
                assert q is not None
                # A draft whose logits are not finite has no distribution (`q` NaN):
                # its token is refused and the model draws its own from `p`.
                if not draw(self.key + offset, KEEP) * q[token] < p[token]:
                    residual = np.maximum(p - q, 0.0)
                    if not residual.sum() > 0.0:  # p == q to rounding, or q NaN: draw from p
                        residual = p
                    return [*kept, pick(residual, draw(self.key + offset, NEXT))]
            kept.append(token)
        last = len(drafted)
        if self.greedy:
            return [*kept, int(np.argmax(logits[last]))]
        p = softmax(logits[last], self.temperature)
        return [*kept, pick(p, draw(self.key + last, NEXT))]
