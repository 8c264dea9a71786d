"""MAX's CPU workers yield to the Python that drives them, and the engine's poller to both,
in-process and under `max serve`."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from gpt2_max.shims.runtime_threads import (
    DEFAULT_NICE,
    MAX_NICE,
    NICE_ENV,
    configured_nice,
    engine_pollers,
    idle_engine_poller,
    worker_threads,
    yield_to_main_thread,
)


def test_the_nice_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    assert configured_nice() == DEFAULT_NICE
    for value, nice in (("0", 0), (" 5 ", 5), ("19", 19)):
        monkeypatch.setenv(NICE_ENV, value)
        assert configured_nice() == nice
    for bad in ("20", "-1", "ten", "2.5"):
        monkeypatch.setenv(NICE_ENV, bad)
        with pytest.raises(ValueError, match=NICE_ENV):
            configured_nice()


def _nice(pid: int, tid: int) -> int:
    """A thread's nice value, read from /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_a_loaded_generator_leaves_max_workers_below_its_main_thread(generator) -> None:
    workers = worker_threads()
    # None found means the runtime named its workers otherwise.
    assert workers
    main = _nice(os.getpid(), os.getpid())
    assert [_nice(os.getpid(), tid) for tid in workers] == [
        min(MAX_NICE, main + DEFAULT_NICE)
    ] * len(workers)


def test_a_generator_that_ran_leaves_only_max_engine_poller_idle(generator) -> None:
    generator.generate([464, 2068], 2)  # the process's first execute starts the poller
    pollers = engine_pollers()
    # None found means MAX's engine no longer runs such a thread.
    assert len(pollers) == 1
    idle = {tid for tid in map(int, os.listdir("/proc/self/task"))
            if _scheduler(tid) == os.SCHED_IDLE}
    assert idle == set(pollers)


def _scheduler(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except ProcessLookupError:  # the thread ended meanwhile
        return None


def test_the_served_model_worker_runs_max_workers_below_its_main_thread(
    gpt2_max_server,
) -> None:
    tree = psutil.Process(gpt2_max_server.pid).children(recursive=True)
    lowered = {
        p.pid: [_nice(p.pid, tid) - _nice(p.pid, p.pid) for tid in worker_threads(p.pid)]
        for p in tree
    }
    # Exactly the process that builds the model (the model worker) lowers its workers.
    (offsets,) = [offsets for offsets in lowered.values() if any(offsets)]
    assert offsets and set(offsets) == {DEFAULT_NICE}, lowered


def test_a_system_refusing_priorities_costs_a_warning_not_the_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        "gpt2_max.shims.runtime_threads.worker_threads", lambda: [os.getpid()]
    )
    monkeypatch.setattr(os, "setpriority", _refuse)
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert yield_to_main_thread(5) == []
    assert "keep their priority" in caplog.text
    assert yield_to_main_thread(0) == []


def test_the_served_model_worker_idles_its_engine_poller(gpt2_max_server) -> None:
    gpt2_max_server.client.completions.create(
        model=gpt2_max_server.model, prompt="Hello", max_tokens=2
    )
    tree = psutil.Process(gpt2_max_server.pid).children(recursive=True)
    pollers = {p.pid: engine_pollers(p.pid) for p in tree}
    # Only the model worker runs graphs, so only it has the poller.
    (worker,) = [pid for pid, found in pollers.items() if found]
    assert [os.sched_getscheduler(tid) for tid in pollers[worker]] == [os.SCHED_IDLE]


def test_no_worker_nice_leaves_the_engine_poller_as_max_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NICE_ENV, "0")
    monkeypatch.setattr(os, "sched_setscheduler", _refuse)
    assert idle_engine_poller() == []


def test_a_system_refusing_the_idle_class_costs_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    monkeypatch.setattr(
        "gpt2_max.shims.runtime_threads.engine_pollers", lambda: [os.getpid()]
    )
    monkeypatch.setattr(os, "sched_setscheduler", _refuse)
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert idle_engine_poller() == []
    assert "keeps its priority" in caplog.text


def _refuse(*args: object) -> None:
    raise PermissionError(1, "Operation not permitted")
