"""MAX's CPU workers yield to the Python that drives them, in-process and under `max serve`."""

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

    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert yield_to_main_thread(5) == []
    assert "keep their priority" in caplog.text
    assert yield_to_main_thread(0) == []
