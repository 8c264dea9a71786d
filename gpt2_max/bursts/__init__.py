"""Decode bursts: several decode steps in one pass of MAX's loop.

MAX 26.7 runs one decode step per `execute`, and on the CPU each pass of its
loop around that step (the scheduler, `prepare_batch`, the sampler's set-up,
metrics, a message to the API process) costs a good share of a small model's
step. A burst pays for that loop once every `K` tokens:

- `DecodeBursts` (the pipeline model's extension, `extensions`): when every row of a batch is
  decoding one token, the model runs the graph, samples its logits with MAX's
  own sampler graph and sampling inputs, and runs the graph again on that
  token, up to `K` steps and a time budget, inside the KV pages MAX already
  gave each row; a request arriving at MAX's scheduler ends the burst at the
  next step (`shims.waiting_requests`). It returns the first step's logits, as
  ever, and hands each row the tokens it made.
- `BurstContext` (the architecture's context type): when MAX commits a row's
  first token, and only if that token is the one the burst sampled from the
  same logits, the context appends the rest, so MAX's own end-of-text,
  `max_tokens` and window checks see every token and one output carries them.

Rows that need what only MAX's loop does per token (log-probabilities, a
grammar, logits processors, penalties, echo) and chunked or mixed prefill
batches run one step a pass. `GPT2_MAX_DECODE_STEPS` sets `K` (1 turns bursts
off), `GPT2_MAX_BURST_MS` the budget.
"""

from typing import Any

from ..shims import fast_forward
from .context import BurstContext, FastForwardBurstContext
from .model import DecodeBursts, decode_steps

__all__ = ["BurstContext", "DecodeBursts", "FastForwardBurstContext", "decode_steps"]


def extend(model: Any) -> DecodeBursts:
    return DecodeBursts()


def context_type(base: type) -> type:
    """The context type that takes a burst's tokens (with fast-forward tokens when
    `GPT2_MAX_FAST_FORWARD` is on)."""
    return FastForwardBurstContext if fast_forward.enabled() else BurstContext
