"""`shims.echo_penalties`: MAX 26.7 cannot build its sampler graph with penalties beside
echo's ragged logits (the behaviour the shim leans on, checked so a release that mends
it is noticed); built with the shim, the graph penalizes each request's row as the graph
without echo does, and refuses logits of more rows than requests.

That a served request's penalties are applied beside `--enable-echo` is tested in
`tests/test_serve.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.pipelines.lib import SamplingConfig
from max.pipelines.sampling import sampling

from gpt2_max.shims import echo_penalties

pytestmark = pytest.mark.tier("model")

VOCAB = 32
ROWS = 3
RNG = np.random.default_rng(5)
LOGITS = RNG.normal(0, 2.0, (ROWS, VOCAB)).astype(np.float32)
REPEATED = [np.argsort(row)[-3:] for row in LOGITS]
"""Per row, the tokens seen before (prompt and generated): its three largest logits,
so penalties move the greedy choice."""
REPETITION = np.array([1.0, 3.0, 0.5], np.float32)
PRESENCE = np.array([2.5, 0.0, 0.0], np.float32)
FREQUENCY = np.array([0.0, 0.0, 1.0], np.float32)


def build(variable_logits: bool, patched: bool = True):
    echo_penalties.install()
    apply = sampling.apply_penalties_to_logits
    if not patched:
        sampling.apply_penalties_to_logits = apply.__wrapped__
    try:
        config = SamplingConfig(enable_penalties=True, enable_variable_logits=variable_logits)
        return sampling.token_sampler(config, DeviceRef.CPU())
    finally:
        sampling.apply_penalties_to_logits = apply


def frequencies(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """MAX's CSR of `[token, count]` pairs per row, each token seen twice."""
    data = np.concatenate([np.stack([row, np.full(len(row), 2)], 1) for row in rows])
    offsets = np.cumsum([0] + [len(row) for row in rows])
    return data.astype(np.int32), offsets.astype(np.uint32)


def greedy(graph, logits: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray:
    """The graph's greedy token per request, each request's rows ending at `offsets`."""
    data, data_offsets = frequencies(REPEATED)
    arrays = [
        logits, np.zeros((ROWS, 0), np.int64), np.ones(ROWS, np.int64), np.array(1, np.int64),
        np.ones(ROWS, np.float32), np.ones(ROWS, np.float32), np.array(1.0, np.float32),
        np.zeros(ROWS, np.float32), np.arange(ROWS, dtype=np.uint64),
        *([] if offsets is None else [offsets.astype(np.uint32)]),
        data, data_offsets, data, data_offsets, FREQUENCY, PRESENCE, REPETITION,
    ]
    model = InferenceSession(devices=[CPU()]).load(graph)
    return model(*[Buffer.from_numpy(a) for a in arrays])[0].to_numpy()


def expected() -> np.ndarray:
    """MAX's penalties by hand: repetition divides a positive logit (multiplies a
    negative one), then frequency and presence are taken off per count."""
    tokens = []
    for row, seen, rep, pres, freq in zip(LOGITS, REPEATED, REPETITION, PRESENCE, FREQUENCY,
                                          strict=True):
        row = row.copy()
        row[seen] = np.where(row[seen] > 0, row[seen] / rep, row[seen] * rep)
        row[seen] -= 2 * freq + pres
        tokens.append(int(row.argmax()))
    return np.array(tokens)


def test_maxs_graph_with_echos_ragged_logits_refuses_penalties() -> None:
    with pytest.raises(ValueError, match="does not match logits_buffer shape"):
        build(variable_logits=True, patched=False)


def test_with_the_shim_each_request_is_penalized_as_without_echo() -> None:
    want = expected()
    assert (want != LOGITS.argmax(1)).sum() >= 2  # the penalties decide
    plain = greedy(build(variable_logits=False), LOGITS)
    ragged = greedy(build(variable_logits=True), LOGITS, np.arange(ROWS + 1))
    assert plain.reshape(-1).tolist() == want.tolist()
    assert ragged.reshape(-1).tolist() == want.tolist()


def test_logits_of_more_rows_than_requests_are_refused() -> None:
    """Every prompt position's logits (what echo's graph also returns) are not what the
    pipeline samples from: the graph says so rather than penalize the wrong rows."""
    rows = np.concatenate([LOGITS[:1], LOGITS])
    with pytest.raises(Exception, match="more rows than requests"):
        greedy(build(variable_logits=True), rows, np.array([0, 2, 3, 4]))
