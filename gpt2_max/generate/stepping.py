"""Stepping: a fixed batch of rows through MAX's `GenerateIterator`, one step at a time.

`GenerateIterator.from_contexts` runs the batch with MAX's sampler and each
context's own sampling parameters and logits processors (a grammar's mask
among them). Around each step this books what MAX cannot: text released past
stop strings, log-probabilities, and tokens a grammar forces, which ride along
in the next step instead of taking one of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from max.pipelines.context import TextContext
from max.pipelines.lib.generate import GenerateIterator
from max.pipelines.modeling.types import RequestID

from .results import FINISH_REASONS, Row


class StepRecorder:
    """The pipeline as `GenerateIterator` sees it, keeping each step's outputs.

    A batch from `from_contexts` hands back only token ids; the log-probabilities
    MAX computes for a context that asks for them travel in the step's outputs.
    """

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self.outputs: dict[RequestID, Any] = {}
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def execute(self, inputs: Any) -> Any:
        self.outputs = self._pipeline.execute(inputs)
        self.steps += 1
        return self.outputs


def prefill(pipeline: StepRecorder, context: TextContext) -> None:
    """Runs one context's prompt, so its full KV pages land in the prefix cache."""
    with GenerateIterator.from_contexts(pipeline, [context], caller="Generator") as batch:
        while not batch.done:
            batch.step()


def run(pipeline: StepRecorder, rows: list[Row]) -> Iterator[tuple[int, str]]:
    """Steps `rows` as one batch until each ends; yields (row, released text)."""
    contexts = [row.context for row in rows]
    with GenerateIterator.from_contexts(pipeline, contexts, caller="Generator") as batch:
        while not batch.done:
            for index, new_tokens in batch.step().items():
                row = rows[index]
                piece = ""
                # Sampled tokens of one execute (a decode burst, a draft's round) are
                # taken one at a time, as steps of their own would bring them, so a stop
                # string ends the row at the token that completes it.
                each = [new_tokens] if row.mask else [[token] for token in new_tokens]
                for tokens in each:
                    _advance(pipeline, row, tokens)
                    piece += row.stops.feed(row.text.feed(row.tokens))
                    if row.stops.stopped:
                        break
                if not _continues(row):
                    piece += row.stops.feed(row.text.flush(row.tokens)) + row.stops.flush()
                    row.finish_reason = "stop" if row.stops.stopped else row.finish_reason
                    batch.remove(index)
                if piece:
                    yield index, piece


def _advance(pipeline: StepRecorder, row: Row, new_tokens: list[int]) -> None:
    """Books one step's tokens: forced ones from the step before, then the sampled one."""
    row.tokens.extend(new_tokens)
    row.steps += 1
    if row.logprobs is not None:
        output = pipeline.outputs[row.context.request_id]
        (sampled,) = output.log_probabilities
        row.logprobs += [None] * row.pending_forced + sampled.token_log_probabilities
        row.top_logprobs += [{}] * row.pending_forced + sampled.top_log_probabilities
    row.pending_forced = 0
    if row.mask and not row.context.is_done:
        row.mask.consume(new_tokens[-1])


def _continues(row: Row) -> bool:
    """Whether the row takes another step; if not, records why it ended."""
    if row.context.is_done:
        row.finish_reason = FINISH_REASONS[row.context.status]
    elif row.stops.stopped or (row.mask and row.mask.finished):
        row.finish_reason = "stop"
    elif row.mask is None:
        return True
    else:
        forced = row.mask.fast_forward(row.context)
        if not row.mask.finished:
            row.pending_forced = len(forced)
            return True
        # The forced tokens complete the grammar: they need no step of their own.
        row.tokens += forced
        if row.logprobs is not None and row.top_logprobs is not None:
            row.logprobs += [None] * len(forced)
            row.top_logprobs += [{}] * len(forced)
        row.finish_reason = "stop"
    return False
