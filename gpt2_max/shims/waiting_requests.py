"""Whether a request waits at MAX's scheduler, told to the pipeline model, so a
decode burst (`gpt2_max.bursts`) ends as soon as one arrives.

MAX 26.7's text scheduler pulls new requests from its request queue only between
passes of its loop, and the model cannot see that queue. A burst that keeps
going while a request waits delays that request's first token by the rest of
the burst. This patch of `TokenGenerationScheduler.__init__` hands a model that
asks for it (`model.takes("waiting_requests")`) a probe of the scheduler's own
queue, which looks without taking: the request stays where MAX pulls it from.
A request the scheduler would leave in the queue anyway (its pending pool at
`--max-pending-requests`) does not count.
"""

from __future__ import annotations

from max.serve.scheduler.text_generation_scheduler import TokenGenerationScheduler

from .internals import pipeline_model, request_waiting
from .patching import after_init, asks


def _hand_over(scheduler: TokenGenerationScheduler) -> None:
    # Only a model that asks: no other scheduler's queue is looked at.
    model = pipeline_model(scheduler.pipeline)
    if not asks(model, "waiting_requests"):
        return
    queued = request_waiting(scheduler.request_queue)
    if queued is None:
        return
    cap = scheduler.max_pending_requests
    if cap is None:
        model.hand_over("waiting_requests", queued)
    else:
        pool = scheduler.batch_constructor  # its pending requests, counted as MAX counts them
        model.hand_over("waiting_requests", lambda: queued() and len(pool.all_ce_reqs) < cap)


def install() -> None:
    """Patches `TokenGenerationScheduler.__init__` once per process."""
    after_init(TokenGenerationScheduler, "watches_requests", _hand_over)
