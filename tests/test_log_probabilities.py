"""`LogProbabilities`: MAX's log-probabilities, their graph compiled by the first
request that asks, equal to what MAX's own `LogProbabilitiesMixin` computes.

That the served and generated log-probabilities match transformers is tested
through the server and the generator (`tests/test_serve.py`, `tests/generate`).
"""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.nn.transformer import ReturnLogits
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.lib import ModelOutputs, ModuleV3PipelineModelWithKVCache, PipelineModel
from max.pipelines.lib.log_probabilities import LogProbabilitiesMixin

from gpt2_max.log_probabilities import LogProbabilities
from gpt2_max.model import GPT2PipelineModel

pytestmark = pytest.mark.tier("model")

VOCAB = 97


def step(seed: int = 0) -> tuple[SimpleNamespace, ModelOutputs, Buffer]:
    """Two rows (3 and 2 tokens), their last-position logits and sampled tokens."""
    logits = np.random.default_rng(seed).normal(0, 3, (2, VOCAB)).astype(np.float32)
    inputs = SimpleNamespace(
        tokens=Buffer.from_numpy(np.array([5, 6, 7, 8, 9], dtype=np.int64)),
        input_row_offsets=Buffer.from_numpy(np.array([0, 3, 5], dtype=np.uint32)),
    )
    outputs = ModelOutputs(
        logits=Buffer.from_numpy(logits), next_token_logits=Buffer.from_numpy(logits)
    )
    return inputs, outputs, Buffer.from_numpy(np.array([11, 40], dtype=np.int64))


def test_the_graph_compiles_at_the_first_request_and_gives_log_softmax() -> None:
    device = CPU()
    session = InferenceSession(devices=[device])
    log_probabilities = LogProbabilities(device)
    assert log_probabilities._graph is None  # nothing compiled at start
    inputs, outputs, sampled = step()
    rows = log_probabilities.compute(
        session, inputs, outputs, sampled, [3, 0], [False, False], ReturnLogits.LAST_TOKEN
    )
    assert log_probabilities._graph is not None
    logits = outputs.next_token_logits.to_numpy()
    expected = logits[0] - np.log(np.exp(logits[0] - logits[0].max()).sum()) - logits[0].max()
    assert rows[1] is None  # top_n 0: none asked
    assert rows[0].token_log_probabilities == pytest.approx([expected[11]], abs=1e-5)
    top = rows[0].top_log_probabilities[0]
    assert set(top) >= set(np.argsort(expected)[-3:].tolist())
    assert all(top[token] == pytest.approx(expected[token], abs=1e-5) for token in top)


def test_the_same_rows_as_maxs_mixin() -> None:
    device = CPU()
    session = InferenceSession(devices=[device])
    ours = LogProbabilities(device)
    inputs, outputs, sampled = step(seed=1)
    got = ours.compute(
        session, inputs, outputs, sampled, [2, 5], [False, False], ReturnLogits.LAST_TOKEN
    )
    # MAX's mixin method, on an object holding what its `__init__` would have set.
    mixin = SimpleNamespace(
        _logprobs_device=device, _logprobs_model=ours._graph,
        return_logits=ReturnLogits.LAST_TOKEN,
    )
    theirs = LogProbabilitiesMixin.compute_log_probabilities(
        mixin, session, inputs, outputs, sampled, [2, 5], [False, False]
    )
    assert got == theirs


@pytest.mark.tier("unit")
def test_the_model_answers_maxs_call_as_the_base_class_declares_it() -> None:
    def parameters(method: object) -> list[tuple[str, object]]:
        return [(p.name, p.kind) for p in inspect.signature(method).parameters.values()]

    declared = parameters(PipelineModel.compute_log_probabilities)
    assert parameters(GPT2PipelineModel.compute_log_probabilities) == declared
    assert "compute_log_probabilities" not in vars(ModuleV3PipelineModelWithKVCache)


@pytest.mark.tier("unit")
def test_echo_without_every_positions_logits_is_refused_by_name() -> None:
    inputs, outputs, sampled = step()
    with pytest.raises(ValueError, match="enable_echo"):
        LogProbabilities(CPU()).compute(
            None, inputs, outputs, sampled, [1, 1], [True, False],  # type: ignore[arg-type]
            ReturnLogits.LAST_TOKEN,
        )


def test_a_prompt_prefilled_again_after_a_preemption_is_echoed_once() -> None:
    """MAX prefills a request it preempts while it decodes again, its tokens so far as
    the prompt (`TextContext.reset`); its echo answered that prompt a second time in the
    middle of the answer. The second prefill is scored as without echo: the sampled
    token's entry alone."""
    device = CPU()
    session = InferenceSession(devices=[device])
    ours = LogProbabilities(device)
    context = TextContext(max_length=64, tokens=TokenBuffer(np.array([5, 6, 7], dtype=np.int64)))

    def prefill(context: TextContext, tokens: list[int], sampled: int, seed: int) -> list:
        logits = np.random.default_rng(seed).normal(0, 3, (len(tokens), VOCAB)).astype(np.float32)
        inputs = SimpleNamespace(
            tokens=Buffer.from_numpy(np.array(tokens, dtype=np.int64)),
            input_row_offsets=Buffer.from_numpy(np.array([0, len(tokens)], dtype=np.uint32)),
            contexts=[context],
        )
        outputs = ModelOutputs(logits=Buffer.from_numpy(logits),
                               next_token_logits=Buffer.from_numpy(logits[-1:]))
        (row,) = ours.compute(session, inputs, outputs,
                              Buffer.from_numpy(np.array([sampled], dtype=np.int64)),
                              [1], [True], ReturnLogits.ALL)
        last = logits[-1] - logits[-1].max()
        assert row.token_log_probabilities[-1] == pytest.approx(
            last[sampled] - np.log(np.exp(last).sum()), abs=1e-5)
        return row.token_log_probabilities

    assert len(prefill(context, [5, 6, 7], sampled=11, seed=2)) == 3  # tokens 6 and 7, then 11
    context.update(11)
    context.update(12)
    context.reset()  # preempted: [5, 6, 7, 11, 12] is the prompt now
    assert len(prefill(context, [5, 6, 7, 11, 12], sampled=13, seed=3)) == 1
    del context
    gc.collect()
    assert not ours._echoed  # forgotten with the request
