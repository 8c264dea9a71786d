"""`PlainRowsSampler`: plain rows (greedy, or a temperature with no top-k, top-p or
min-p) drawn from softmax(logits / temperature) by this package's graph, seeded rows
repeated, other rows handed to MAX's sampler graph (a call with no sampled plain row
whole and unchanged), each row drawn as it would be alone.

That served and generated sampling go through it (and bursts with it) is tested in
`tests/bursts/test_served.py` and `tests/generate/test_generator.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.pipelines.lib import SamplingConfig
from max.pipelines.sampling import batch_max_k, token_sampler

from gpt2_max.sampler import PlainRowsSampler, PlainRowsSampling
from gpt2_max.sampler.plain_rows import uniform_draws
from gpt2_max.settings import setting, settings
from tests.stats import chi_square_fits

pytestmark = pytest.mark.tier("model")

VOCAB = 50


def router(**config: bool) -> PlainRowsSampler:
    """The router in front of MAX's own sampler graph, as the text pipeline builds it."""
    device = CPU()
    session = InferenceSession(devices=[device])
    graph = token_sampler(SamplingConfig(**config), DeviceRef.CPU())
    return PlainRowsSampler(session.load(graph), device)


@pytest.fixture(scope="module")
def sampler() -> PlainRowsSampler:
    return router()


@pytest.fixture(scope="module")
def masking_sampler() -> PlainRowsSampler:
    """With MAX's graph built for a min-tokens mask (`--enable-min-tokens`)."""
    return router(enable_min_tokens=True)


def inputs(logits: np.ndarray, *, top_k: int = -1, temperature: float = 1.0,
           top_p: float = 1.0, min_p: float = 0.0, seeds: np.ndarray | None = None
           ) -> list[Buffer]:
    """MAX's sampler inputs (`SamplerInputs.as_list` after logits and previous tokens)
    for every row of `logits` alike."""
    rows = len(logits)
    seeds = np.arange(rows, dtype=np.uint64) if seeds is None else seeds
    arrays = [
        logits.astype(np.float32), np.zeros((rows, 3), np.int64),
        np.full(rows, top_k, np.int64), np.array(top_k if top_k > 0 else -1, np.int64),
        np.full(rows, temperature, np.float32), np.full(rows, top_p, np.float32),
        np.array(top_p, np.float32), np.full(rows, min_p, np.float32), seeds,
    ]
    return [Buffer.from_numpy(a) for a in arrays]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_plain_rows_are_drawn_from_the_softmax(sampler, temperature) -> None:
    """20,000 draws of one row's token (one row per seed, in one call) against
    softmax(logits / temperature): Pearson's chi-square over the tokens."""
    logits = np.random.default_rng(0).normal(0, 2, VOCAB)
    draws = 20_000
    batch = np.repeat(logits[None], draws, axis=0)
    seeds = np.random.default_rng(1).integers(0, 2**63, draws).astype(np.uint64)
    tokens, all_tokens, next_seeds = sampler(
        *inputs(batch, temperature=temperature, seeds=seeds)
    )
    tokens = tokens.to_numpy()
    expected = softmax(logits / temperature) * draws
    counts = np.bincount(tokens, minlength=VOCAB).astype(float)
    chi2, bound = chi_square_fits(counts, expected)
    assert chi2 < bound, (chi2, bound)
    assert (all_tokens.to_numpy()[:, -1] == tokens).all()
    assert (next_seeds.to_numpy() == seeds + 1).all()


def test_greedy_rows_take_the_largest_logit_beside_sampled_ones(sampler) -> None:
    logits = np.random.default_rng(2).normal(0, 2, (4, VOCAB))
    buffers = inputs(logits)
    top_k = np.array([1, -1, 1, -1], np.int64)
    buffers[2] = Buffer.from_numpy(top_k)
    buffers[4] = Buffer.from_numpy(np.array([0.0, 1.0, 0.0, 1.0], np.float32))
    tokens = sampler(*buffers)[0].to_numpy()
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_a_seed_repeats_its_tokens_and_another_seed_differs(sampler) -> None:
    logits = np.zeros((64, VOCAB))  # every token as likely
    seeds = np.arange(1000, 1064, dtype=np.uint64)
    first = sampler(*inputs(logits, seeds=seeds))[0].to_numpy()
    again = sampler(*inputs(logits, seeds=seeds))[0].to_numpy()
    other = sampler(*inputs(logits, seeds=seeds + 64))[0].to_numpy()
    assert (first == again).all()
    assert (first != other).any()


def test_uniform_draws_fill_the_unit_interval_evenly() -> None:
    draws = uniform_draws(np.arange(100_000, dtype=np.uint64))  # consecutive keys
    assert draws.dtype == np.float32 and 0 <= draws.min() and draws.max() < 1
    counts = np.histogram(draws, bins=20, range=(0, 1))[0]
    assert np.abs(counts - 5000).max() < 5 * np.sqrt(5000)


@pytest.mark.parametrize("options", [
    dict(top_k=20), dict(top_p=0.9), dict(min_p=0.05),
], ids=["top-k", "top-p", "min-p"])
def test_rows_that_need_a_sort_go_to_maxs_sampler(sampler, options) -> None:
    calls = []

    def fallback(*buffers):
        calls.append(buffers)
        return ["MAX's"]

    router = PlainRowsSampler.__new__(PlainRowsSampler)
    router.__dict__.update(sampler.__dict__, _fallback=fallback)
    buffers = inputs(np.zeros((2, VOCAB)), **options)
    assert router(*buffers) == ["MAX's"]
    assert len(calls) == 1 and calls[0] == tuple(buffers)
    assert router(*buffers, Buffer.from_numpy(np.zeros(2, np.float32))) == ["MAX's"]
    assert router.plain_rows(tuple(inputs(np.zeros((2, VOCAB)))) + (buffers[0],)) is None


def test_a_batch_of_greedy_rows_takes_the_largest_logits_as_maxs_graph_does(sampler) -> None:
    """Greedy rows alone go to the package's greedy graph, whatever top-p or min-p they
    name (the largest logit passes both), with MAX's outputs; greedy rows beside rows
    that need a sort go to MAX's graph with them."""
    logits = np.random.default_rng(4).normal(0, 2, (3, VOCAB))
    greedy = inputs(logits, top_k=1, temperature=0.0, top_p=0.5, min_p=0.5)
    assert sampler.plain_rows(tuple(greedy)).all()
    ours = [b.to_numpy() for b in sampler(*greedy)]
    maxs = [b.to_numpy() for b in sampler._fallback(*greedy)]
    assert (ours[0] == logits.argmax(axis=1)).all()
    for mine, theirs in zip(ours, maxs, strict=True):
        assert (mine.reshape(theirs.shape) == theirs).all()
    top_k = Buffer.from_numpy(np.array([1, 1, 20], np.int64))
    beside = (*greedy[:2], top_k, *greedy[3:])
    assert sampler.plain_rows(beside) is None


@pytest.mark.parametrize(("value", "replaced"), [("package", True), ("max", False)])
def test_the_setting_chooses_whose_sampler_the_pipeline_calls(monkeypatch, value, replaced):
    maxs = object()
    monkeypatch.setenv(setting("sampler").variable, value)
    settings.cache_clear()
    try:
        chosen = PlainRowsSampling().sampler(None, maxs, CPU())
    finally:
        settings.cache_clear()
    assert isinstance(chosen, PlainRowsSampler) is replaced
    assert (chosen is maxs) is not replaced


def test_a_min_tokens_mask_bans_its_tokens_as_maxs_graph_does(sampler) -> None:
    """MAX's mask of (row, token) pairs (`--enable-min-tokens`) is written into the
    logits buffer, so a banned largest logit gives way to the next."""
    logits = np.random.default_rng(3).normal(0, 2, (2, VOCAB))
    best = logits.argmax(axis=1)
    buffers = inputs(logits)
    buffers[2] = Buffer.from_numpy(np.array([1, -1], np.int64))  # row 0 greedy
    mask = Buffer.from_numpy(np.array([[0, best[0]], [1, best[1]]], np.int32))
    assert sampler.plain_rows((*buffers, mask)).all()
    tokens = sampler(*buffers, mask)[0].to_numpy()
    assert tokens[0] == np.argsort(logits[0])[-2]
    assert buffers[0].to_numpy()[1, best[1]] == -10000.0


def test_a_min_tokens_mask_bans_its_tokens_in_a_call_of_greedy_rows(sampler) -> None:
    logits = np.random.default_rng(5).normal(0, 2, (2, VOCAB))
    best = logits.argmax(axis=1)
    buffers = inputs(logits, top_k=1, temperature=0.0)
    mask = Buffer.from_numpy(np.array([[0, best[0]]], np.int32))  # row 0's largest banned
    tokens = sampler(*buffers, mask)[0].to_numpy()
    assert tokens[0] == np.argsort(logits[0])[-2] and tokens[1] == best[1]


ROWS = [dict(), dict(top_k=5), dict(temperature=0.7), dict(top_p=0.8),
        dict(top_k=1, temperature=0.0), dict(min_p=0.05), dict(top_k=VOCAB)]
"""Rows of every kind: plain (sampled, greedy, a top-k of the whole vocabulary) and
restricted (top-k, top-p, min-p)."""


def rows_inputs(logits: np.ndarray, rows: list[dict], seeds: np.ndarray,
                banned: dict[int, int] | None = None) -> list[Buffer]:
    """MAX's sampler inputs for `rows`, each with its own options, as the text pipeline
    makes them (`batch_max_k`, the least top-p); `banned` a min-tokens mask, row to token."""
    def each(name, default, dtype):
        return np.array([row.get(name, default) for row in rows], dtype)

    top_k, top_p = each("top_k", -1, np.int64), each("top_p", 1.0, np.float32)
    arrays = [
        logits.astype(np.float32), np.tile(np.arange(3, dtype=np.int64), (len(rows), 1)),
        top_k, np.array(batch_max_k(top_k), np.int64), each("temperature", 1.0, np.float32),
        top_p, np.array(top_p.min(), np.float32), each("min_p", 0.0, np.float32), seeds,
    ]
    if banned is not None:
        arrays.append(np.array(sorted(banned.items()), np.int32).reshape(-1, 2))
    return [Buffer.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("banned", [None, {0: 7, 1: 3, 5: 9}], ids=["", "min-tokens-mask"])
def test_each_row_draws_as_it_would_alone_whatever_rows_share_its_batch(
    sampler, masking_sampler, banned
):
    """A plain row's token came from MAX's graph when a restricted row shared its batch,
    and from this package's otherwise: a seeded request's tokens changed with the
    requests beside it."""
    sampler = sampler if banned is None else masking_sampler
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 2, (len(ROWS), VOCAB))
    seeds = rng.integers(0, 2**63, len(ROWS)).astype(np.uint64)
    banned = banned or {}
    alone = [
        [out.to_numpy()[0] for out in sampler(*rows_inputs(
            logits[i : i + 1], ROWS[i : i + 1], seeds[i : i + 1],
            {0: banned[i]} if i in banned else ({} if banned else None)))]
        for i in range(len(ROWS))
    ]
    together = rows_inputs(logits, ROWS, seeds, banned or None)
    tokens, all_tokens, next_seeds = (out.to_numpy() for out in sampler(*together))
    assert list(tokens) == [row[0] for row in alone]
    assert (all_tokens == np.array([row[1] for row in alone])).all()
    assert (next_seeds == seeds + 1).all()
    for row, token in banned.items():
        assert together[0].to_numpy()[row, token] == -10000.0 and tokens[row] != token
