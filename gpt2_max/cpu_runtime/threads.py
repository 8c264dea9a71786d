"""MAX's CPU worker threads, made to yield to the Python thread that drives them.

A decode step on the CPU is two graphs (the model, then MAX's sampler) run by
the runtime's worker threads, with Python around them on the main thread:
input building, the pipeline's bookkeeping and, under `max serve`, the
scheduler, while the API process beside it streams each token. After every
graph the workers spin for a while before they sleep, and at equal priority
Linux shares each core between a spinning worker and whatever has real work,
so on a machine with few cores all that Python runs at a fraction of its
speed and adds milliseconds to every step. A worker a few nice levels below
the main thread gives its core up as soon as the Python has work, and still
has the cores to itself while a graph runs, when the main thread waits.

MAX's engine also starts a thread of its own at a process's first graph
execute (from `executeFromDriver`, never named) that wakes on a short timer,
thousands of times a second, idle or not. At normal priority each wake
preempts a worker that is streaming weights, and the op in flight waits for
that worker to come back. Put in Linux's idle class (`SCHED_IDLE`) it runs on
a core nothing else wants, or when one frees, and never preempts a worker.

The workers are found by the name the Mojo runtime gives them, the engine's
poller as the thread the model's load and first execute started that wakes
that often; neither is promised by any MAX API: a MAX that named the workers
otherwise, or had no such poller, is left alone, and
`tests/cpu_runtime/test_threads.py` fails by name. Only speed depends on
any of this, so no error of it reaches the model: it logs a warning.
`GPT2_MAX_WORKER_NICE=0` leaves every MAX thread as MAX set it.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from ..names import PACKAGE
from ..settings import MAX_NICE, setting, settings

logger = logging.getLogger("max.pipelines")

NICE_ENV = setting("worker_nice").variable
"""Nice levels the runtime's workers run below the main thread; 0 leaves them be."""

WORKER_NAME_PREFIX = "\N{FIRE} Thread"
"""What the Mojo runtime names its CPU worker threads (`🔥 Thread0`, ...)."""

POLLER_WAKES_PER_S = 1000
"""A new thread that wakes more often than this is the engine's poller: it wakes many
times as often, and no other thread of a served or in-process model comes near
(`docs/performance.md`, "Runtime threads")."""
POLLER_SAMPLE_S = 0.02
"""How long `engine_pollers` counts wakes for."""


def configured_nice() -> int:
    """How many nice levels below the main thread the workers go (`GPT2_MAX_WORKER_NICE`)."""
    return settings().worker_nice


def _tasks(pid: int | None) -> str:
    return f"/proc/{'self' if pid is None else pid}/task"


def thread_ids(pid: int | None = None) -> set[int]:
    """Every thread of process `pid` (default: this one; Linux only, empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return set()
    return {int(tid) for tid in os.listdir(_tasks(pid))}


def _name(pid: int | None, tid: int) -> str | None:
    """A thread's name, or None if it ended meanwhile."""
    try:
        with open(f"{_tasks(pid)}/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _wakes(pid: int | None, tids: list[int]) -> dict[int, int]:
    """How many times each of `tids` has gone to sleep and woken (its voluntary context
    switches); a thread that ended, or whose count the system does not give, is left out."""
    wakes = {}
    for tid in tids:
        try:
            with open(f"{_tasks(pid)}/{tid}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        wakes[tid] = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return wakes


def worker_threads(pid: int | None = None) -> list[int]:
    """Thread ids of the MAX runtime's CPU workers in process `pid` (default: this one;
    Linux only, empty elsewhere)."""
    return sorted(
        tid for tid in thread_ids(pid)
        if (_name(pid, tid) or "").startswith(WORKER_NAME_PREFIX)
    )


def engine_pollers(
    pid: int | None = None, *, among: set[int] | None = None,
    sample_s: float = POLLER_SAMPLE_S,
) -> list[int]:
    """Thread ids of MAX's engine poller in process `pid` (default: this one): the
    threads (of `among`, if given) other than the runtime's workers that wake more than
    `POLLER_WAKES_PER_S` times a second over `sample_s`. Empty before the process's
    first graph execute."""
    candidates = [
        tid for tid in (thread_ids(pid) if among is None else among)
        if not (_name(pid, tid) or "").startswith(WORKER_NAME_PREFIX)
    ]
    if not candidates:
        return []
    before = _wakes(pid, candidates)
    time.sleep(sample_s)
    after = _wakes(pid, list(before))
    return sorted(
        tid for tid, wakes in after.items()
        if wakes - before[tid] > POLLER_WAKES_PER_S * sample_s
    )


def yield_to_main_thread(nice: int | None = None) -> list[int]:
    """Puts the runtime's workers `nice` levels (default: `configured_nice()`) below this
    process's main thread, capped at the lowest priority, and returns the thread ids it
    lowered; where the system refuses, it warns and the workers stay as they were."""
    nice = configured_nice() if nice is None else nice
    if nice == 0:
        return []
    lowered = []
    try:
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        for tid in worker_threads():
            # On Linux a thread id names one thread, so only the workers change.
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(target, current))
            lowered.append(tid)
    except OSError as error:
        # A sandbox that refuses priorities costs speed, never the model.
        logger.warning(f"{PACKAGE}: MAX's CPU workers keep their priority: %s", error)
    else:
        if lowered:
            logger.debug(f"{PACKAGE}: MAX's %d CPU workers at nice %d", len(lowered), target)
    return lowered


def idle_engine_poller(existing: set[int]) -> list[int]:
    """Puts MAX's engine poller in the idle scheduling class, unless
    `GPT2_MAX_WORKER_NICE` is 0, and returns the thread ids it moved.

    Call it after the model's first execute, which starts the poller, with the
    threads `existing` before the model loaded (`thread_ids()`): only a thread
    started since counts, so a busy thread of the program around the model is never
    taken for it. A poller an earlier graph of the process started is left as it is.
    """
    if configured_nice() == 0:
        return []
    idled = []
    try:
        for tid in engine_pollers(among=thread_ids() - existing):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # it ended meanwhile
                continue
            idled.append(tid)
    except Exception as error:  # noqa: BLE001 (a speed setting must never fail a step)
        logger.warning(f"{PACKAGE}: MAX's engine poller keeps its priority: %s", error)
    return idled
