"""MAX's CPU workers yield to the Python that drives them, and the engine's poller to both,
in-process and under `max serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpt2_max.cpu_runtime.threads import (
    MAX_NICE,
    NICE_ENV,
    engine_pollers,
    idle_engine_poller,
    thread_ids,
    worker_threads,
    yield_to_main_thread,
)
from gpt2_max.settings import Settings
from gpt2_max.testing.server import child_env

pytestmark = pytest.mark.tier("unit")

DEFAULT_NICE = Settings.read({}).worker_nice


def _nice(pid: int, tid: int) -> int:
    """A thread's nice value, read from /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.tier("model")
def test_a_loaded_generator_leaves_max_workers_below_its_main_thread(generator) -> None:
    workers = worker_threads()
    # None found means the runtime named its workers otherwise.
    assert workers
    main = _nice(os.getpid(), os.getpid())
    assert [_nice(os.getpid(), tid) for tid in workers] == [
        min(MAX_NICE, main + DEFAULT_NICE)
    ] * len(workers)


GENERATOR_POLLER_SCRIPT = """
import json, os, sys, time
from gpt2_max.generate import Generator
from gpt2_max.cpu_runtime.threads import engine_pollers, thread_ids
settle_s, sample_s = float(sys.argv[2]), float(sys.argv[3])
with Generator(sys.argv[1], device="cpu", max_batch_size=1) as generator:
    generator.generate([464, 2068], 2)
    time.sleep(settle_s)
    idle = []
    for tid in thread_ids():
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                idle.append(tid)
        except ProcessLookupError:
            pass
    print(json.dumps({"pollers": engine_pollers(sample_s=sample_s), "idle": idle}))
"""
SETTLE_S = 0.3
"""How long after a graph the runtime's workers are given to stop spinning, so that a
thread in the idle class wakes as often as it would on an idle machine."""
SAMPLE_S = 0.3


@pytest.mark.tier("model")
def test_a_generator_that_ran_has_max_engine_poller_alone_in_the_idle_class(
    gpt2_max_checkpoint: Path,
) -> None:
    # A process of its own: in this one an earlier test's graph may have started the
    # poller before any model loaded, and the shim leaves alone a thread it did not see
    # start.
    result = subprocess.run(
        [sys.executable, "-c", GENERATOR_POLLER_SCRIPT, str(gpt2_max_checkpoint),
         str(SETTLE_S), str(SAMPLE_S)],
        capture_output=True, text=True, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # No poller found means MAX's engine no longer runs such a thread.
    assert len(found["pollers"]) == 1
    assert sorted(found["idle"]) == found["pollers"]


@pytest.mark.tier("serve")
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
        "gpt2_max.cpu_runtime.threads.worker_threads", lambda: [os.getpid()]
    )
    monkeypatch.setattr(os, "setpriority", _refuse)
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert yield_to_main_thread(5) == []
    assert "keep their priority" in caplog.text
    assert yield_to_main_thread(0) == []


@pytest.mark.tier("serve")
def test_the_served_model_worker_has_its_engine_poller_alone_in_the_idle_class(
    gpt2_max_server,
) -> None:
    gpt2_max_server.client.completions.create(
        model=gpt2_max_server.model, prompt="Hello", max_tokens=2
    )
    time.sleep(SETTLE_S)
    tree = psutil.Process(gpt2_max_server.pid).children(recursive=True)
    pollers = {p.pid: engine_pollers(p.pid, sample_s=SAMPLE_S) for p in tree}
    # Only the model worker runs graphs, so only it has the poller.
    (worker,) = [pid for pid, found in pollers.items() if found]
    idle = [tid for tid in thread_ids(worker) if _scheduler(tid) == os.SCHED_IDLE]
    assert len(pollers[worker]) == 1
    assert sorted(idle) == pollers[worker]


def test_no_worker_nice_leaves_the_engine_poller_as_max_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NICE_ENV, "0")
    monkeypatch.setattr(
        "gpt2_max.cpu_runtime.threads.engine_pollers", lambda among: [os.getpid()]
    )
    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda *args: calls.append(args))
    assert idle_engine_poller(set()) == []
    assert calls == []


def test_only_a_thread_started_since_the_load_can_be_the_poller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    seen = []

    def pollers(among: set[int]) -> list[int]:
        seen.append(among)
        return sorted(among)

    monkeypatch.setattr("gpt2_max.cpu_runtime.threads.engine_pollers", pollers)
    monkeypatch.setattr(os, "sched_setscheduler", lambda *args: None)
    assert idle_engine_poller(thread_ids()) == []
    assert seen == [set()]


def test_a_system_refusing_the_idle_class_costs_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    monkeypatch.setattr(
        "gpt2_max.cpu_runtime.threads.engine_pollers", lambda among: [os.getpid()]
    )
    monkeypatch.setattr(os, "sched_setscheduler", _refuse)
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert idle_engine_poller(set()) == []
    assert "keeps its priority" in caplog.text


def _scheduler(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except ProcessLookupError:  # the thread ended meanwhile
        return None


def _refuse(*args: object) -> None:
    raise PermissionError(1, "Operation not permitted")
