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

One rule holds whatever the server's flags: a sampled token's entries are those of
the distribution it was drawn from, after the penalties and the `min_tokens` mask MAX's
sampler applies to the last rows' logits in place (MAX's semantics, where vLLM reports
the model's own); a prompt's, under echo, are the model's own. MAX's ragged computation
reads every row from the every-position logits when the model returns them
(`--enable-echo`), unedited, so on such a server a request's answer was scored by the
model's distribution and the same request elsewhere by the sampled one. Here the sampled
tokens are always scored from the last rows, and echo's prompt from every position.

A prompt that chunked prefill splits (`--max-batch-input-tokens`, or a batch's other
prompts taking the step's room) is scored chunk by chunk. MAX's context keeps no
log-probabilities from a step that ends inside the prompt, and its graph scores that
step's last row against the token the sampler drew there rather than the prompt's next
one, so echo reported the last chunk's prompt tokens alone. Each chunk here scores its
last row against the prompt's next token and is kept until the step that ends the
prompt, which answers for the whole prompt.

MAX puts a request back in its queue (`TextContext.reset`) when the KV cache runs
short: while it decodes, to be prefilled again with its tokens so far as its prompt,
whose entries MAX's echo answered a second time in the middle of the answer; or
between two chunks of its prompt, to go on after the pages the prefix cache kept.
So an echoing request's state lives as long as its context, not to MAX's `release`,
which it calls on both: its prompt is answered once, and its later prefills are
scored as a request without echo.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
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
from max.pipelines.modeling.types import RequestID

from .shims.internals import log_probabilities_heap_levels


@dataclass
class EchoedPrompt:
    """An echoing request's prompt, kept while MAX holds its context."""

    context: weakref.ref[Any]
    scored: TokenLogProbabilities | None = None
    """Its entries so far, while chunked prefill splits it (tokens 1 to the last
    chunk's end)."""
    answered: bool = False
    """Whether its entries have been answered."""


class LogProbabilities:
    """MAX's log-probabilities for one pipeline model's steps, on its device."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._graph: Model | None = None
        self._prompts: dict[RequestID, EchoedPrompt] = {}
        """Per echoing request, its prompt, until MAX drops its context."""

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
        ragged: Any = inputs  # tokens, input_row_offsets and contexts, as `GPT2Inputs`
        contexts: list[Any] = list(getattr(ragged, "contexts", ()) or [None] * len(batch_echo))
        # Echo without `logprobs` (served without `--enable-echo` too) needs no scores.
        batch_echo = [echo and top_n > 0 and not self._answered(context)
                      for echo, top_n, context in zip(batch_echo, batch_top_n, contexts,
                                                      strict=True)]
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
        inside = [echo and context is not None and context.tokens.actively_chunked
                  for echo, context in zip(batch_echo, contexts, strict=True)]
        offsets, tokens = ragged.input_row_offsets.to_numpy(), ragged.tokens.to_numpy()
        sampled = next_tokens.to_numpy()
        # Each row's sampled token from the logits it was drawn from: the sampler's
        # penalties and `min_tokens` mask edit them in place, as a server without echo
        # reports them. The every-position logits of echo are the model's own.
        drawn = compute_log_probabilities_ragged(
            self._device, self._graph, input_row_offsets=offsets, logits=None,
            next_token_logits=outputs.next_token_logits, tokens=tokens,
            sampled_tokens=sampled,
            batch_top_n=[0 if chunk else top_n
                         for chunk, top_n in zip(inside, batch_top_n, strict=True)],
            batch_echo=[False] * len(batch_echo),
        )
        if not any(batch_echo):
            return drawn
        scored = sampled.copy()
        for row, context in enumerate(contexts):
            if inside[row]:  # the prompt's token after this chunk
                scored[row] = context.tokens.all[context.tokens.current_position]
        echoed = compute_log_probabilities_ragged(
            self._device, self._graph, input_row_offsets=offsets, logits=outputs.logits,
            next_token_logits=outputs.next_token_logits, tokens=tokens, sampled_tokens=scored,
            batch_top_n=[top_n if echo else 0
                         for echo, top_n in zip(batch_echo, batch_top_n, strict=True)],
            batch_echo=batch_echo,
        )
        answers = []
        for row, context in enumerate(contexts):
            answer = _answer_drawn(echoed[row], drawn[row]) if batch_echo[row] else drawn[row]
            if batch_echo[row] and context is not None:
                answer = self._whole_prompt(context, answer, inside[row])
            answers.append(answer)
        return answers

    def _whole_prompt(
        self, context: Any, result: TokenLogProbabilities | None, inside: bool
    ) -> TokenLogProbabilities | None:
        """`result`, an echoing row's, after its prompt's earlier chunks; kept instead
        while the step ends `inside` the prompt, else the prompt is answered."""
        prompt = self._prompt(context)
        earlier, prompt.scored = prompt.scored, None
        if result is not None and earlier is not None:
            # This step scores from `processed_length` + 1 on: less than the earlier
            # chunks reached where the prompt is prefilled again (from the start, or
            # after the pages the prefix cache kept).
            kept = context.tokens.processed_length
            result = _joined(earlier, kept, result)
        if inside:
            prompt.scored = result
        else:
            prompt.answered = True
        return result

    def _prompt(self, context: Any) -> EchoedPrompt:
        """`context`'s prompt, recorded at its first echoing step and forgotten when
        MAX drops the context."""
        request_id, prompts = context.request_id, self._prompts
        prompt = prompts.get(request_id)
        if prompt is None or prompt.context() is not context:
            prompt = prompts[request_id] = EchoedPrompt(
                weakref.ref(context, lambda _: prompts.pop(request_id, None)))
        return prompt

    def _answered(self, context: Any) -> bool:
        """Whether `context`'s prompt has been echoed (it is prefilled again after a
        preemption)."""
        prompt = None if context is None else self._prompts.get(context.request_id)
        return prompt is not None and prompt.context() is context and prompt.answered


def _answer_drawn(
    echoed: TokenLogProbabilities | None, drawn: TokenLogProbabilities | None
) -> TokenLogProbabilities | None:
    """`echoed`, a prompt's entries and its sampled token's, that token's entry taken
    from `drawn` (None inside the prompt, where the row's last entry is the prompt's)."""
    if echoed is None or drawn is None:
        return echoed
    return _joined(echoed, -1, drawn)


def _joined(
    head: TokenLogProbabilities, end: int, tail: TokenLogProbabilities
) -> TokenLogProbabilities:
    """`head`'s entries before `end`, then `tail`'s (each field a list, a token an
    item)."""
    return TokenLogProbabilities(**{
        name: getattr(head, name)[:end] + getattr(tail, name)
        for name in TokenLogProbabilities.__struct_fields__
    })
