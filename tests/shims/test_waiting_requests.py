"""The scheduler's request queue reaches a model that watches it, and counts as a
waiting request only what MAX's scheduler would take at its next pass.

MAX's own `TokenGenerationScheduler.__init__` stands in for a stub that sets the
fields the real one sets (`tests/shims/test_internals.py` pins those), so no
pipeline or KV cache is built.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from max.serve.scheduler.text_generation_scheduler import TokenGenerationScheduler
from max.serve.worker_interface._zmq_queue import ZmqConfig

from gpt2_max.shims import waiting_requests
from gpt2_max.shims.internals import request_waiting

pytestmark = pytest.mark.tier("unit")


class Model:
    """Takes the probe, as `GPT2PipelineModel` does when its bursts extension is there."""

    waiting = None

    def takes(self, part: str) -> bool:
        return part == "waiting_requests"

    def hand_over(self, part: str, waiting) -> None:
        self.waiting = waiting


class NotAsking(Model):
    def takes(self, part: str) -> bool:
        return False


class Pipeline:
    def __init__(self, model: Any) -> None:
        self._pipeline_model = model


class Pool:
    all_ce_reqs: dict = {}


def fields(self, pipeline, *, request_queue, max_pending_requests=None) -> None:
    self.pipeline, self.request_queue = pipeline, request_queue
    self.max_pending_requests, self.batch_constructor = max_pending_requests, Pool()


@pytest.fixture
def scheduler(monkeypatch):
    """Builds a scheduler, patched as `shims.install` patches it, over a stub init."""
    monkeypatch.setattr(TokenGenerationScheduler, "__init__", fields)
    waiting_requests.install()
    return TokenGenerationScheduler


def queued(config: ZmqConfig):
    """A pull socket holding one request, and its push end."""
    pull, push = config.pull(), config.push()
    push.put([7])
    waiting, deadline = request_waiting(pull), time.monotonic() + 5
    while not waiting() and time.monotonic() < deadline:  # it crosses ZMQ's I/O thread
        time.sleep(0.001)
    return pull, push


def test_a_watching_model_sees_a_request_wait_until_the_scheduler_takes_it(scheduler):
    model = Model()
    pull, _push = queued(ZmqConfig[list[int]](list[int]))
    scheduler(Pipeline(model), request_queue=pull)
    assert model.waiting is not None and model.waiting()
    pull.get_nowait()
    assert not model.waiting()


def test_a_request_left_queued_by_a_full_pending_pool_does_not_count(scheduler):
    model = Model()
    pull, _push = queued(ZmqConfig[list[int]](list[int]))
    built = scheduler(Pipeline(model), request_queue=pull, max_pending_requests=2)
    assert model.waiting()
    built.batch_constructor.all_ce_reqs = {"a": None, "b": None}
    assert not model.waiting()


def test_models_that_do_not_ask_and_other_queues_are_left_alone(scheduler):
    scheduler(Pipeline(object()), request_queue=ZmqConfig[list[int]](list[int]).pull())
    for model in (NotAsking(), Model()):
        scheduler(Pipeline(model), request_queue=[])
        assert model.waiting is None


def test_install_patches_once():
    waiting_requests.install()
    patched = TokenGenerationScheduler.__init__
    waiting_requests.install()
    assert TokenGenerationScheduler.__init__ is patched
    assert patched.watches_requests
