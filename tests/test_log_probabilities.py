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


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


class EchoSteps:
    """MAX's log-probabilities of one echoing request's steps, as its pipeline asks."""

    def __init__(self, prompt: list[int]) -> None:
        device = CPU()
        self.session = InferenceSession(devices=[device])
        self.ours = LogProbabilities(device)
        self.context = TextContext(max_length=64, tokens=TokenBuffer(np.array(prompt)))
        self.logits: dict[int, np.ndarray] = {}
        """Per position, the logits of its row at the step that scored it last."""

    def step(self, sampled: int, seed: int) -> list[float]:
        tokens = self.context.tokens
        start, rows = tokens.processed_length, tokens.active_length
        logits = np.random.default_rng(seed).normal(0, 3, (rows, VOCAB)).astype(np.float32)
        self.logits.update((start + i, logits[i]) for i in range(rows))
        inputs = SimpleNamespace(
            tokens=Buffer.from_numpy(np.asarray(tokens.active, dtype=np.int64)),
            input_row_offsets=Buffer.from_numpy(np.array([0, rows], dtype=np.uint32)),
            contexts=[self.context],
        )
        outputs = ModelOutputs(logits=Buffer.from_numpy(logits),
                               next_token_logits=Buffer.from_numpy(logits[-1:]))
        (row,) = self.ours.compute(self.session, inputs, outputs,
                                   Buffer.from_numpy(np.array([sampled], dtype=np.int64)),
                                   [1], [True], ReturnLogits.ALL)
        return row.token_log_probabilities

    def preempt(self) -> None:
        """What MAX does to a request it puts back in its queue
        (`_return_to_request_queue`): the pipeline's `release` (the package's model
        handed it on to a `release` here before), then the context's reset."""
        getattr(self.ours, "release", lambda request_id: None)(self.context.request_id)
        self.context.reset()

    def expected(self, sequence: list[int]) -> list[float]:
        """Each of `sequence`'s tokens after the first, scored by its position's row."""
        return [float(log_softmax(self.logits[i - 1])[sequence[i]])
                for i in range(1, len(sequence))]


def test_a_prompt_prefilled_again_after_a_preemption_is_echoed_once() -> None:
    """MAX prefills a request it preempts while it decodes again, its tokens so far as
    the prompt (`TextContext.reset`); its echo answered that prompt a second time in the
    middle of the answer. The second prefill is scored as without echo: the sampled
    token's entry alone."""
    steps = EchoSteps([5, 6, 7])
    assert steps.step(sampled=11, seed=2) == pytest.approx(steps.expected([5, 6, 7, 11]),
                                                           abs=1e-5)
    steps.context.update(11)
    steps.context.update(12)
    steps.preempt()  # [5, 6, 7, 11, 12] is the prompt now
    assert steps.step(sampled=13, seed=3) == pytest.approx(
        steps.expected([5, 6, 7, 11, 12, 13])[-1:], abs=1e-5)
    ours = steps.ours
    del steps
    gc.collect()
    assert not ours._prompts  # forgotten with the request


def test_a_prompt_preempted_between_its_chunks_is_echoed_whole() -> None:
    """MAX also puts back a prompt that chunked prefill splits, between two chunks (its
    KV pages short), and prefills it again after the pages the prefix cache kept: the
    entries of the tokens before those pages come from the earlier chunks."""
    prompt = list(range(5, 15))
    steps = EchoSteps(prompt)
    for chunk, seed in ((4, 1), (3, 2)):
        steps.context.tokens.chunk(chunk)
        steps.step(sampled=99, seed=seed)  # the sampler's draw inside the prompt: unused
        steps.context.tokens.advance_chunk()
    steps.preempt()
    steps.context.tokens.skip_processing(4)  # the first four tokens' pages still cached
    answered = steps.step(sampled=40, seed=3)
    assert len(answered) == len(prompt)
    assert answered == pytest.approx(steps.expected(prompt + [40]), abs=1e-5)


def test_echo_without_logprobs_needs_no_scores() -> None:
    """Echo without `logprobs` is served without `--enable-echo` too: beside a request
    asking for log-probabilities it failed the whole step for want of every position's
    logits."""
    inputs, outputs, sampled = step()
    rows = LogProbabilities(CPU()).compute(
        InferenceSession(devices=[CPU()]), inputs, outputs, sampled, [0, 2], [True, False],
        ReturnLogits.LAST_TOKEN,
    )
    assert rows[0] is None and len(rows[1].token_log_probabilities) == 1


def test_sampled_tokens_are_scored_from_the_logits_they_were_drawn_from() -> None:
    """With every position's logits (`--enable-echo`), MAX scored each row's sampled
    token from them, the model's own, while the sampler draws it from the last rows
    its penalties and `min_tokens` mask edit in place: a row's answer is scored from
    those, with echo or without, as on a server without every position's logits."""
    prompt = [5, 6, 7]
    context = TextContext(max_length=64, tokens=TokenBuffer(np.array(prompt)))
    rng = np.random.default_rng(4)
    every = rng.normal(0, 3, (5, VOCAB)).astype(np.float32)  # rows 3 and 2 tokens
    edited = rng.normal(0, 3, (2, VOCAB)).astype(np.float32)  # the sampler's last rows
    inputs = SimpleNamespace(
        tokens=Buffer.from_numpy(np.array(prompt + [8, 9], dtype=np.int64)),
        input_row_offsets=Buffer.from_numpy(np.array([0, 3, 5], dtype=np.uint32)),
        contexts=[context, None],
    )
    outputs = ModelOutputs(logits=Buffer.from_numpy(every),
                           next_token_logits=Buffer.from_numpy(edited))
    echoed, plain = LogProbabilities(CPU()).compute(
        InferenceSession(devices=[CPU()]), inputs, outputs,
        Buffer.from_numpy(np.array([11, 40], dtype=np.int64)), [2, 2], [True, False],
        ReturnLogits.ALL,
    )
    assert echoed.token_log_probabilities == pytest.approx(
        [log_softmax(every[0])[6], log_softmax(every[1])[7], log_softmax(edited[0])[11]],
        abs=1e-5)
    assert plain.token_log_probabilities == pytest.approx([log_softmax(edited[1])[40]],
                                                          abs=1e-5)
    top = plain.top_log_probabilities[0]
    assert set(top) >= set(np.argsort(edited[1])[-2:].tolist())
