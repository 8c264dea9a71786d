"""Log-probabilities of a step's tokens, MAX's computation, its graph compiled when first asked for.

A request that asks for `logprobs` gets them from the logits the model's graph
returns, through MAX's own log-probabilities graph (`log_probabilities_ragged_graph`)
and its host-side ragged computation (`compute_log_probabilities_ragged`). MAX's
architectures take both through `LogProbabilitiesMixin`, whose `__init__` compiles
that graph at every start, in the model worker, whether or not any request will
ask: the longest step of a cold start after the model's and the sampler's
compiles (`benchmarks/bench_start.py`, phase "after"). The pipeline model owns a
`LogProbabilities` instead (composition, no mixin) and answers MAX's
`compute_log_probabilities` through it: the same graph at MAX's heap depth, compiled
by the first request that asks.
"""

from __future__ import annotations

from typing import Any

from max.driver import Buffer, Device
from max.engine import InferenceSession, Model
from max.graph import DeviceRef
from max.nn.transformer import ReturnLogits
from max.pipelines.context import LogProbabilities as TokenLogProbabilities
from max.pipelines.lib import ModelInputs, ModelOutputs
from max.pipelines.lib.log_probabilities import (
    compute_log_probabilities_ragged,
    log_probabilities_ragged_graph,
)

from .shims.internals import log_probabilities_heap_levels


class LogProbabilities:
    """MAX's log-probabilities for one pipeline model's steps, on its device."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._graph: Model | None = None

    def compute(
        self,
        session: InferenceSession,
        inputs: ModelInputs,
        outputs: ModelOutputs,
        next_tokens: Buffer,
        batch_top_n: list[int],
        batch_echo: list[bool],
        return_logits: ReturnLogits,
    ) -> list[TokenLogProbabilities | None]:
        """Each row's log-probabilities (None where its `top_n` is 0): the sampled
        token's, the top `top_n`, and with `echo` the prompt's too, which needs the
        logits of every position (`--enable-echo`)."""
        all_logits = return_logits in (ReturnLogits.ALL, ReturnLogits.VARIABLE)
        if any(batch_echo) and not all_logits:
            raise ValueError(
                "Log probabilities with echo=true requires enable_echo=true "
                "in the pipeline configuration to return logits for all tokens."
            )
        assert outputs.next_token_logits is not None
        if self._graph is None:
            self._graph = session.load(log_probabilities_ragged_graph(
                DeviceRef.from_device(self._device), levels=log_probabilities_heap_levels()
            ))
        ragged: Any = inputs  # tokens and input_row_offsets, as `GPT2Inputs` has them
        return compute_log_probabilities_ragged(
            self._device,
            self._graph,
            input_row_offsets=ragged.input_row_offsets.to_numpy(),
            logits=outputs.logits if all_logits else None,
            next_token_logits=outputs.next_token_logits,
            tokens=ragged.tokens.to_numpy(),
            sampled_tokens=next_tokens.to_numpy(),
            batch_top_n=batch_top_n,
            batch_echo=batch_echo,
        )
