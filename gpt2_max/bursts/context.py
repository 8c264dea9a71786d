"""The context type that takes a burst's tokens after MAX commits the first."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from max.pipelines.context import TextContext

from ..names import PACKAGE
from ..shims.fast_forward import FastForwardContext

logger = logging.getLogger("max.pipelines")


def extra_steps(context: TextContext, page_size: int) -> int:
    """How many steps past the first a burst may run this row: 0 when the row
    needs MAX's loop for each token, else the room left in its KV pages and its
    window."""
    if not isinstance(context, BurstContext) or context.bursts_off:
        return 0
    tokens = context.tokens
    if tokens.active_length != 1 or tokens.actively_chunked:
        return 0  # a prefill (or its chunk), or forced tokens riding along
    if (context.log_probabilities or context.log_probabilities_echo
            or context.json_schema is not None or context.grammar is not None
            or context.matcher is not None or context.label_token_ids
            or context.sampling_params.logits_processors):
        return 0
    position = tokens.current_position
    # MAX allocates the pages up to this step's token; a burst writes the KV of
    # one more token per step, and must not go past the last page or the window.
    page_room = -(-position // page_size) * page_size - position
    return max(0, min(page_room, context.max_length - position - 1))


@dataclass(kw_only=True)
class BurstContext(TextContext):
    """`TextContext` that appends the tokens a decode burst made for it."""

    bursts_off = False  # a class attribute, not a field: MAX's messages never carry it
    """Set for good once MAX's token differs from the burst's: the row decodes one
    token a pass from then on."""

    _burst = None

    def expect_burst(self, tokens: list[int]) -> None:
        """The tokens a burst made: the first is the one MAX is about to sample."""
        self._burst = tokens

    def advance_fsm(self, token: int) -> bool:
        # MAX calls this right after appending its sampled token, before it takes
        # the step's output and allocates the next step's KV pages.
        handled = super().advance_fsm(token)
        burst, self._burst = self._burst, None
        if not burst or self.is_done:
            return handled
        if token != burst[0]:
            self.bursts_off = True
            logger.warning(
                f"{PACKAGE}: request {self.request_id}: MAX sampled token {token} where "
                f"the burst sampled {burst[0]} from the same logits; its other "
                f"{len(burst) - 1} token(s) are dropped and the request decodes one "
                "token a step from here"
            )
            return handled
        for next_token in burst[1:]:
            self.advance_token_buffer(next_token)
            super().advance_fsm(next_token)
            if self.is_done:
                break
        return handled


@dataclass(kw_only=True)
class FastForwardBurstContext(FastForwardContext, BurstContext):
    """Both: a grammar's forced tokens (`shims.fast_forward`) on constrained rows,
    bursts on the others (which a grammar never has). The context type under
    `GPT2_MAX_FAST_FORWARD=1`."""
