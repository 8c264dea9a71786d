"""The harness stops the whole `max serve` process tree, not just its leader."""

from __future__ import annotations

import os
import subprocess

import psutil

from gpt2_max.testing import server


def process_group(pgid: int) -> list[psutil.Process]:
    group = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                group.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return group


def test_stop_process_group_ends_children_that_outlive_the_leader(monkeypatch):
    monkeypatch.setattr(server, "STOP_TIMEOUT_S", 1)
    # The leader exits at once; its children ignore SIGTERM, as a busy worker may.
    leader = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 300 & sleep 300 & echo started"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    with leader.stdout:
        assert leader.stdout.readline() == b"started\n"
    children = [p for p in process_group(leader.pid) if p.pid != leader.pid]
    assert len(children) == 2

    server.stop_process_group(leader)

    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
