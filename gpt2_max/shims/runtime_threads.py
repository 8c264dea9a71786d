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

The workers are found by the name the Mojo runtime gives them, which no MAX
API promises: a MAX that named them otherwise leaves them alone, and
`tests/shims/test_runtime_threads.py` fails by name.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("max.pipelines")

NICE_ENV = "GPT2_MAX_WORKER_NICE"
"""Nice levels the runtime's workers run below the main thread; 0 leaves them be."""

DEFAULT_NICE = 10
MAX_NICE = 19
"""The lowest priority Linux has."""

WORKER_NAME_PREFIX = "\N{FIRE} Thread"
"""What the Mojo runtime names its CPU worker threads (`🔥 Thread0`, ...)."""


def configured_nice() -> int:
    """How many nice levels below the main thread the workers go: `GPT2_MAX_WORKER_NICE`,
    else `DEFAULT_NICE`."""
    raw = os.environ.get(NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"{NICE_ENV} must be an integer from 0 to {MAX_NICE}, not {raw!r}")
    return nice


def worker_threads(pid: int | None = None) -> list[int]:
    """Thread ids of the MAX runtime's CPU workers in process `pid` (default: this one;
    Linux only, empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    tasks = f"/proc/{'self' if pid is None else pid}/task"
    workers = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(WORKER_NAME_PREFIX):
            workers.append(int(tid))
    return sorted(workers)


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
        logger.warning("gpt2_max: MAX's CPU workers keep their priority: %s", error)
    else:
        if lowered:
            logger.debug("gpt2_max: MAX's %d CPU workers at nice %d", len(lowered), target)
    return lowered
