"""Which drafted tokens a row keeps: greedy as one step at a time, sampled rows with
the model's own distribution (rejection sampling), seeded draws that repeat."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpt2_max.speculate.accept import RowSampling, softmax
from tests.stats import chi_square_fits

pytestmark = pytest.mark.tier("unit")

VOCAB = 6
RNG = np.random.default_rng(3)
MODEL = RNG.normal(0, 1.5, (VOCAB, VOCAB))
"""The model's next-token logits after each token: a chain over a small vocabulary."""
DRAFT = MODEL + RNG.normal(0, 0.8, (VOCAB, VOCAB))
"""A draft that mostly agrees with it."""


def generate(row: RowSampling, start: int, count: int, drafts: int) -> tuple[list[int], int]:
    """`count` tokens after `start`, made as the extension makes them: rounds of
    `drafts` drafted tokens, checked by the model at every drafted position. Returns
    the tokens and the rounds it took."""
    out, rounds = [start], 0
    while len(out) <= count:
        sampler = RowSampling(row.greedy, row.temperature, row.key + len(out) - 1)
        drafted, proposals, previous = [], [], out[-1]
        for offset in range(drafts):
            token, q = sampler.propose(DRAFT[previous], offset)
            drafted.append(token)
            proposals.append(q)
            previous = token
        logits = np.stack([MODEL[t] for t in (out[-1], *drafted)])
        out += sampler.accept(logits, drafted, proposals)
        rounds += 1
    return out[1 : count + 1], rounds


def test_a_greedy_row_keeps_drafted_tokens_while_they_are_the_models_choice() -> None:
    row = RowSampling(greedy=True, temperature=1.0, key=0)
    logits = np.full((4, VOCAB), -1.0)
    for offset, best in enumerate([2, 5, 1, 3]):
        logits[offset, best] = 1.0
    assert row.accept(logits, [2, 5, 1], [None] * 3) == [2, 5, 1, 3]
    assert row.accept(logits, [2, 4, 1], [None] * 3) == [2, 5]
    assert row.accept(logits, [0, 5, 1], [None] * 3) == [2]


def test_a_greedy_row_makes_the_tokens_of_one_step_at_a_time() -> None:
    one_at_a_time = [0]
    for _ in range(12):
        one_at_a_time.append(int(np.argmax(MODEL[one_at_a_time[-1]])))
    row = RowSampling(greedy=True, temperature=1.0, key=0)
    for drafts in (1, 3, 5):
        assert generate(row, 0, 12, drafts)[0] == one_at_a_time[1:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_rows_have_the_models_distribution(temperature) -> None:
    """20,000 seeded runs of three tokens after a fixed one, three drafted tokens a
    round: the three tokens' joint counts against the model's chain, by Pearson's
    chi-square over all 216 sequences. The draft differs from the model, so tokens
    are refused and redrawn as well as kept."""
    runs, length = 20_000, 3
    keys = np.random.default_rng(1).integers(0, 2**62, runs)
    counts = np.zeros((VOCAB,) * length)
    rounds = 0
    for key in keys:
        tokens, taken = generate(RowSampling(False, temperature, int(key)), 0, length, 3)
        counts[tuple(tokens)] += 1
        rounds += taken
    p = np.stack([softmax(MODEL[t], temperature) for t in range(VOCAB)])
    expected = np.zeros_like(counts)
    for a, b, c in itertools.product(range(VOCAB), repeat=3):
        expected[a, b, c] = p[0, a] * p[a, b] * p[b, c] * runs
    chi2, bound = chi_square_fits(counts.ravel(), expected.ravel())
    assert chi2 < bound, (chi2, bound)
    # Most runs kept drafted tokens: fewer rounds than tokens.
    assert rounds < 0.75 * runs * length, rounds


def test_a_seed_repeats_its_tokens_and_another_seed_differs() -> None:
    row = RowSampling(greedy=False, temperature=1.0, key=77)
    tokens, _ = generate(row, 0, 40, 4)
    assert generate(row, 0, 40, 4)[0] == tokens
    other = RowSampling(greedy=False, temperature=1.0, key=78_000)
    assert generate(other, 0, 40, 4)[0] != tokens


def test_a_draft_without_a_distribution_has_its_tokens_refused() -> None:
    """A draft whose logits are not finite (finite weights can overflow) gives `q` of
    NaN, which the acceptance test compared as a keep: every drafted token was kept,
    the last id each time. Its first token is refused and the next drawn from `p`."""
    row = RowSampling(greedy=False, temperature=1.0, key=5)
    draft = np.full(VOCAB, np.nan)
    token, q = row.propose(draft, 0)
    logits = np.stack([MODEL[0], MODEL[token], MODEL[token]])
    for key in range(200):
        keyed = RowSampling(greedy=False, temperature=1.0, key=key)
        own = keyed.accept(logits[:1], [], [])  # the model's own draw
        assert keyed.accept(logits, [token, token], [q, q]) == own
