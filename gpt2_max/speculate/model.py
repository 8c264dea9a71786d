"""The pipeline-model side of speculative decoding: draft, check, keep.

A decode batch MAX hands the model (each row one token, `x`, at its position `p`)
runs as rounds instead of one step. In a round the draft proposes `k` tokens a row
(`k` draft steps; the first also catches the draft's cache up on the row's tokens it
has not seen), then one step of the model over `x` and the drafted tokens gives its
logits at all `k + 1` positions, and each row keeps what `accept.RowSampling` keeps.
The first round is the pass's step: its logits at `x` are what the model returns to
MAX (for a sampled row, a row of logits that only the kept token can be drawn from,
so MAX's sampler takes that token), and the tokens after it reach MAX as a decode
burst's do (`bursts.BurstContext`). Further rounds follow while the burst budget lasts
and no request waits, each row from its own newest token.

The model's entries for refused tokens lie past the row's cache length, in pages the
row already holds, and the next step writes over them: pages and lengths are as if
nothing had been drafted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from max.driver import Buffer
from max.nn.transformer import ReturnLogits
from max.pipelines.context import TextContext
from max.pipelines.lib import ModelInputs, ModelOutputs

from ..bursts.context import BurstContext, extra_steps
from ..bursts.model import burst_budget_s, step_inputs
from ..extensions import Extension
from ..inputs import GPT2Inputs
from ..model_config import serves_fast_layers
from ..names import PACKAGE
from ..settings import setting, settings
from ..shims import internals
from .accept import RowSampling
from .draft import ENV, Draft
from .pace import Pace

logger = logging.getLogger("max.pipelines")

FORGET_AFTER = 256
"""Passes after which a request not seen is forgotten (it ended, or was evicted and
starts over)."""

REPORT_EVERY = 100
"""Rounds between the log lines that say how many drafted tokens the model kept."""


def row_sampling(context: TextContext, vocab_size: int) -> RowSampling | None:
    """How a row picks its tokens, if a draft can serve it: greedy, or a temperature
    over the whole vocabulary (no top-k, top-p, min-p), with no end-of-text mask
    pending."""
    params = context.sampling_params
    if context.min_tokens > context.tokens.generated_length:
        return None
    key = internals.row_seed(context)
    if params.top_k == 1:
        return RowSampling(greedy=True, temperature=1.0, key=key)
    unrestricted = params.top_k <= 0 or params.top_k >= vocab_size
    if unrestricted and params.top_p >= 1.0 and not params.min_p and params.temperature > 0:
        return RowSampling(greedy=False, temperature=float(params.temperature), key=key)
    return None


class Speculation(Extension):
    """The model's extension for speculative decoding (see the module doc)."""

    takes = frozenset({"waiting_requests"})

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._draft: Draft | None = None
        self._pace = Pace(most=settings().draft_tokens, steady=not settings().draft_pace)
        self._budget_s = burst_budget_s()
        self._request_waiting: Callable[[], bool] | None = None
        self._drafted: dict[Any, tuple[int, int]] = {}
        """Per request: how many of its tokens the draft's cache holds, and the pass
        that last saw it."""
        self._passes = 0
        self._tally = np.zeros(3, dtype=np.int64)
        """Rounds of rows, tokens drafted, drafted tokens kept, since the start."""
        self._requests: dict[Any, tuple[TextContext, np.ndarray]] = {}
        """The same per request that had rounds, with its context, said when it ends
        (`_say_request`)."""

    def load(self, model: Any, load: Callable[[], Any]) -> Any:
        compiled = load()
        if not serves_fast_layers(model.devices[0].is_host):
            plain = setting("layers").variable
            logger.warning(f"{PACKAGE}: {ENV} drafts on the CPU's fast layers only (not on a "
                           f"GPU, nor with {plain}=plain); decoding without a draft")
            return compiled
        sampling = model.pipeline_config.sampling
        if (model.return_logits is not ReturnLogits.LAST_TOKEN or sampling.enable_penalties
                or sampling.enable_variable_logits):
            logger.warning(
                f"{PACKAGE}: {ENV} is set, but this pipeline returns all logits or applies "
                "penalties, which a draft's tokens skip; decoding without a draft"
            )
            return compiled
        self._draft = Draft(model, self._kind)
        logger.info(
            f"{PACKAGE}: decode drafts up to {self._pace.most} tokens a round with "
            f"{self._draft.description}, and the model keeps what it would have chosen"
        )
        return compiled

    def receive(self, model: Any, part: str, *value: Any) -> None:
        if part == "waiting_requests":
            (self._request_waiting,) = value

    def execute(
        self, model: Any, inputs: ModelInputs, run: Callable[[ModelInputs], ModelOutputs]
    ) -> ModelOutputs:
        if self._draft is None or not isinstance(inputs, GPT2Inputs) or not inputs.contexts:
            return run(inputs)
        self._note_passes(inputs.contexts)
        vocab_size = model.huggingface_config.vocab_size
        rows = [row_sampling(c, vocab_size) for c in inputs.contexts]
        rooms = np.array([extra_steps(c, model.kv_params.page_size) for c in inputs.contexts])
        if any(row is None for row in rows) or rooms.min() <= 0:
            return run(inputs)
        if (refused := self._draft.allocate(inputs)) is not None:
            logger.warning(f"{PACKAGE}: {refused}; decoding without a draft")
            self._draft = None
            return run(inputs)
        return self._rounds(model, inputs, run, rows, rooms)

    def _note_passes(self, contexts: Any) -> None:
        """Keeps each row's draft length within what the model's cache holds (an evicted
        request starts over), and forgets requests not seen for `FORGET_AFTER` passes."""
        self._passes += 1
        for request, (context, _) in list(self._requests.items()):
            if context.is_done:
                self._say_request(request)  # it ended at a plain step of the last pass
        for context in contexts:
            held, _ = self._drafted.get(context.request_id, (0, 0))
            self._drafted[context.request_id] = (
                min(held, context.tokens.processed_length), self._passes,
            )
        if self._passes % FORGET_AFTER == 0:
            self._drafted = {
                request: entry for request, entry in self._drafted.items()
                if self._passes - entry[1] < FORGET_AFTER
            }
            for request in set(self._requests) - set(self._drafted):
                self._say_request(request)  # ended at a stop string, or cancelled

    def _rounds(
        self, model: Any, inputs: GPT2Inputs, run: Callable[[ModelInputs], ModelOutputs],
        rows: list[RowSampling], rooms: np.ndarray,
    ) -> ModelOutputs:
        started = time.perf_counter()
        deadline = started + self._budget_s
        contexts = inputs.contexts
        tokens = [list(c.tokens.all[: c.tokens.current_position]) for c in contexts]
        ends = [c.eos_tracker.eos_token_ids for c in contexts]  # as MAX's loop reads them
        made: list[list[int]] = [[] for _ in contexts]
        returned: ModelOutputs | None = None
        mark = started
        while True:
            k = min(self._pace.tokens(), int((rooms - [len(m) for m in made]).min()))
            if k <= 0:
                if returned is None:
                    return run(inputs)  # drafting does not pay: one plain step (or a burst)
                break
            kept, logits = self._round(model, inputs, run, rows, tokens, made, k)
            if returned is None:
                returned = self._for_max(logits[:, 0], rows, kept)
            for row, row_tokens in enumerate(kept):
                made[row] += row_tokens
                tokens[row] += row_tokens
            if all(end.intersection(m) for m, end in zip(made, ends, strict=True)):
                break  # every row has ended; nothing more to make
            now = time.perf_counter()
            if 2 * now - mark > deadline or (
                self._request_waiting is not None and self._request_waiting()
            ):
                break
            mark = now
        for context, row_tokens, row_all, end in zip(contexts, made, tokens, ends, strict=True):
            assert isinstance(context, BurstContext)
            context.expect_burst(row_tokens)
            if end.intersection(row_tokens) or len(row_all) >= context.max_length:
                self._say_request(context.request_id)
        return returned

    def _round(
        self, model: Any, first: GPT2Inputs, run: Callable[[ModelInputs], ModelOutputs],
        rows: list[RowSampling], tokens: list[list[int]], made: list[list[int]], k: int,
    ) -> tuple[list[list[int]], np.ndarray]:
        """One round: `k` drafted tokens a row, checked in one step of the model. Returns
        each row's kept tokens and the model's logits (`[rows, k + 1, vocab]`)."""
        assert self._draft is not None
        contexts = first.contexts
        newest = np.array([len(t) - 1 for t in tokens], dtype=np.int64)  # position of x
        held = np.array([self._drafted[c.request_id][0] for c in contexts], dtype=np.int64)
        sampling = [
            RowSampling(row.greedy, row.temperature, row.key + len(m))
            for row, m in zip(rows, made, strict=True)
        ]
        drafted: list[list[int]] = [[] for _ in contexts]
        proposals: list[list[np.ndarray | None]] = [[] for _ in contexts]
        feed = [np.array(t[h:], dtype=np.int64) for t, h in zip(tokens, held, strict=True)]
        starts = held
        began = time.perf_counter()
        for step in range(k):
            draft_logits = self._draft.logits(first, feed, starts)
            for row, sampler in enumerate(sampling):
                token, q = sampler.propose(draft_logits[row], step)
                drafted[row].append(token)
                proposals[row].append(q)
            starts = newest + 1 + step
            feed = [np.array([d[-1]], dtype=np.int64) for d in drafted]
        check = [
            np.array([t[-1], *d], dtype=np.int64) for t, d in zip(tokens, drafted, strict=True)
        ]
        drafted_at = time.perf_counter()
        outputs = run(step_inputs(first, model.kv_params, check, newest, logits_per_row=k + 1))
        logits = outputs.next_token_logits.to_numpy().reshape(len(contexts), k + 1, -1)
        checked_at = time.perf_counter()
        kept = [
            sampler.accept(logits[row], drafted[row], proposals[row])
            for row, sampler in enumerate(sampling)
        ]
        self._pace.note(k, [len(row) - 1 for row in kept], (drafted_at - began) / k,
                        checked_at - drafted_at)
        self._report(k, kept)
        for row, context in enumerate(contexts):
            _, tally = self._requests.setdefault(
                context.request_id, (context, np.zeros(3, dtype=np.int64))
            )
            tally += (1, k, len(kept[row]) - 1)
            # The draft holds the row's tokens through x and the drafted ones kept, but
            # never wrote the last drafted token's entry.
            valid = int(newest[row]) + 1 + min(len(kept[row]) - 1, k - 1)
            self._drafted[context.request_id] = (valid, self._passes)
        return kept, logits

    def _report(self, k: int, kept: list[list[int]]) -> None:
        """Adds a round to the tally, and says it every `REPORT_EVERY` rounds."""
        before = self._tally[0] // REPORT_EVERY
        self._tally += (len(kept), k * len(kept), sum(len(row) - 1 for row in kept))
        rounds, drafted, taken = (int(n) for n in self._tally)
        if rounds // REPORT_EVERY > before:
            logger.info(
                f"{PACKAGE}: drafts: {rounds} row rounds, {taken} of {drafted} drafted "
                f"tokens kept ({taken / drafted:.0%}), {(taken + rounds) / rounds:.2f} "
                "tokens a row a round"
            )

    def _say_request(self, request: Any) -> None:
        """Logs what a request's rounds kept, once it ends (or is forgotten)."""
        if (entry := self._requests.pop(request, None)) is None:
            return
        _, tally = entry
        rounds, drafted, taken = (int(n) for n in tally)
        logger.info(
            f"{PACKAGE}: request {request}: {taken} of {drafted} drafted tokens kept "
            f"({taken / max(drafted, 1):.0%}) in {rounds} rounds of {drafted / rounds:.1f} "
            f"drafted, {(taken + rounds) / rounds:.2f} tokens a round"
        )

    @staticmethod
    def _for_max(logits: np.ndarray, rows: list[RowSampling], kept: list[list[int]]
                 ) -> ModelOutputs:
        """The first round's logits at each row's `x`, as MAX's loop samples the pass's
        token from them: a greedy row's as the model computed them (their largest is the
        kept token), a sampled row's only its kept token's finite."""
        logits = np.array(logits, dtype=np.float32)
        for row, (sampler, row_tokens) in enumerate(zip(rows, kept, strict=True)):
            if not sampler.greedy:
                logits[row] = -np.inf
                logits[row, row_tokens[0]] = 0.0
        buffer = Buffer.from_numpy(logits)
        return ModelOutputs(logits=buffer, next_token_logits=buffer)
