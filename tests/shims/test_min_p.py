"""`shims.min_p`: MAX 26.7's CPU sampling kernel ignores `min_p` (the behaviour the shim
leans on, checked so a release that mends it is noticed), and MAX's sampler graph built
with the shim keeps only the tokens `min_p` allows, after the graph's own masks.

That a served request's `min_p` is applied is tested in `tests/test_serve.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.pipelines.lib import SamplingConfig
from max.pipelines.sampling import sampling

from gpt2_max.shims import min_p

pytestmark = pytest.mark.tier("model")

VOCAB = 64
ROWS = 32


def sampler_graph(patched: bool, **config: bool):
    """MAX's sampler graph as the text pipeline builds it, with or without the shim."""
    min_p.install()
    fused = sampling.topk_fused_sampling
    if not patched:
        sampling.topk_fused_sampling = fused.__wrapped__
    try:
        graph = sampling.token_sampler(SamplingConfig(**config), DeviceRef.CPU())
    finally:
        sampling.topk_fused_sampling = fused
    return InferenceSession(devices=[CPU()]).load(graph)


@pytest.fixture(scope="module")
def graphs():
    return {patched: sampler_graph(patched) for patched in (False, True)}


LOGITS = np.random.default_rng(0).normal(0, 1.5, VOCAB).astype(np.float32)


def draw(graph, *, min_p_value: float, top_k: int = -1, temperature: float = 1.0,
         top_p: float = 1.0, mask=None) -> np.ndarray:
    """Each of `ROWS` seeds' token for one row of `LOGITS`, in one call."""
    arrays = [
        np.repeat(LOGITS[None], ROWS, axis=0), np.zeros((ROWS, 0), np.int64),
        np.full(ROWS, top_k, np.int64), np.array(top_k if top_k > 0 else -1, np.int64),
        np.full(ROWS, temperature, np.float32), np.full(ROWS, top_p, np.float32),
        np.array(top_p, np.float32), np.full(ROWS, min_p_value, np.float32),
        np.arange(ROWS, dtype=np.uint64) * 7919,
    ]
    if mask is not None:
        arrays.append(mask)
    return graph(*[Buffer.from_numpy(a) for a in arrays])[0].to_numpy().reshape(-1)


def allowed(min_p_value: float, temperature: float, logits: np.ndarray = LOGITS) -> set[int]:
    """The tokens whose probability at `temperature` is at least `min_p` times the largest."""
    ratio = np.exp((logits - logits.max()) / temperature)
    return set(np.flatnonzero(ratio >= min_p_value).tolist())


def test_maxs_cpu_kernel_draws_as_if_min_p_were_0(graphs) -> None:
    unpatched = graphs[False]
    unset = draw(unpatched, min_p_value=0.0)
    for value in (0.5, 1.0):
        assert (draw(unpatched, min_p_value=value) == unset).all()
    assert not set(unset.tolist()) <= allowed(0.5, 1.0)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 20, 1.0), (1.5, -1, 0.9)],
                         ids=["plain", "cooler", "top-k", "top-p"])
@pytest.mark.parametrize("value", [0.1, 0.5])
def test_the_patched_graph_draws_only_what_min_p_allows(graphs, temperature, top_k, top_p,
                                                        value) -> None:
    tokens = set(draw(graphs[True], min_p_value=value, temperature=temperature, top_k=top_k,
                      top_p=top_p).tolist())
    assert tokens <= allowed(value, temperature)
    assert len(tokens) > 1 or len(allowed(value, temperature)) == 1


def test_min_p_1_is_the_largest_logit_and_0_is_unchanged(graphs) -> None:
    assert (draw(graphs[True], min_p_value=1.0) == LOGITS.argmax()).all()
    assert (draw(graphs[True], min_p_value=0.0) == draw(graphs[False], min_p_value=0.0)).all()


def test_min_p_is_cut_after_the_min_tokens_mask() -> None:
    """A banned largest logit (`--enable-min-tokens`) does not set the floor: min_p 1
    draws the largest of the tokens left."""
    graph = sampler_graph(True, enable_min_tokens=True)
    best = int(LOGITS.argmax())
    mask = np.stack([np.arange(ROWS), np.full(ROWS, best)], 1).astype(np.int32)
    tokens = draw(graph, min_p_value=1.0, mask=mask)
    assert (tokens == np.argsort(LOGITS)[-2]).all()


def test_off_the_cpu_the_kernel_call_is_maxs() -> None:
    calls = []

    def fused(logits, top_k, **kwargs):
        calls.append(logits)
        return logits

    class GPU:
        def is_cpu(self) -> bool:
            return False

    class Logits:
        device = GPU()

    logits = Logits()
    min_p.keeps_min_p(fused)(logits, 1, temperature=object(), min_p=object())
    assert calls == [logits]
