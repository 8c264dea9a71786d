"""Fast-forward tokens under `max serve`: a context type that appends the tokens a grammar forces.

MAX 26.7's worker decodes each request as the architecture's `context_type`
(`max/serve/api_server.py:168`, the model worker's request queue) and, after
each step, calls `context.advance_fsm(token)` with the sampled token
(`max/pipelines/lib/pipeline_variants/utils.py:170-173`) before the scheduler
allocates KV pages for the next step
(`serve/scheduler/batch_constructor/text_batch_constructor.py:1450`). So a
`TextContext` subclass can, in `advance_fsm`, append the tokens the grammar
now forces and make them active again: the next step's allocation and token
budget see them, the pipeline fills the bitmask for the position after the
last of them, and the model runs them as extra input of that step.
`to_generation_output`, called right after, returns them with the sampled
token, so the client receives every token (streamed too).

The rule is xgrammar's own bitmask: a token is forced when it is the only one
the matcher allows. The bitmask sampler would pick exactly that token, so a
greedy answer keeps its tokens; only the number of steps drops. Contexts that
ask for log-probabilities are left alone (a forced token has none), a
chunked step (no token appended) forces nothing, and the end-of-text token is
not forced before `min_tokens` (MAX masks it until then).

Off unless `GPT2_MAX_FAST_FORWARD=1` is set in the server's environment:
`gpt2_max.arch` then registers a context type with this one among its bases
(`gpt2_max.bursts.FastForwardBurstContext`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from max.pipelines.context import TextContext

from ..settings import setting, settings
from . import release
from .internals import run_again

ENV = setting("fast_forward").variable


def enabled() -> bool:
    """Whether this process's server runs fast-forward tokens (opt-in, see the module
    doc), on the MAX releases the shims were checked against (`release`)."""
    return settings().fast_forward and release.checked()


def only_allowed_token(matcher: object, vocab_size: int) -> int | None:
    """The one token xgrammar's matcher allows next, or None when it allows several (or none)."""
    inner = matcher._matcher  # type: ignore[attr-defined]  # MAX's XgrammarMatcher adapter
    if inner.is_terminated():
        return None
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    inner.fill_next_token_bitmask(bitmask, 0)
    (words,) = np.nonzero(bitmask[0])
    if len(words) != 1:
        return None
    word = int(bitmask[0, words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = int(words[0]) * 32 + word.bit_length() - 1
    return token if token < vocab_size else None


@dataclass(kw_only=True)
class FastForwardContext(TextContext):
    """`TextContext` whose matcher step appends the tokens the grammar forces next."""

    def advance_token_buffer(self, new_token: int, log_probabilities=None) -> None:
        # A chunked-prefill step appends nothing, yet MAX still calls advance_fsm.
        self._ff_appended = not self.tokens.actively_chunked
        super().advance_token_buffer(new_token, log_probabilities)

    def advance_fsm(self, token: int) -> bool:
        handled = super().advance_fsm(token)
        if not getattr(self, "_ff_appended", False) or self.log_probabilities:
            return handled
        self._ff_appended = False
        forced = 0
        while (not self.is_done and self.matcher is not None and self.grammar_enforced
               and self.vocab_size is not None
               and (next_token := only_allowed_token(self.matcher, self.vocab_size)) is not None):
            if (next_token in self.eos_tracker.eos_token_ids
                    and self.tokens.generated_length < self.min_tokens):
                break  # MAX masks end-of-text until `min_tokens`: its loop decides
            super().advance_token_buffer(next_token)
            super().advance_fsm(next_token)
            forced += 1
        if forced:
            run_again(self.tokens, forced)
        return handled
