"""The harness stops the whole `max serve` process tree, and starts it from any interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_refusal_runs_from_a_venv_that_is_not_activated(gpt2_max_checkpoint, tmp_path):
    """The venv's interpreter, called by path as an IDE or a CI step does, after importing MAX.

    MAX's import leaves `PYTHONEXECUTABLE` (the first `python3` on `PATH`, here
    outside the venv) in the C-level environment; a child that inherits it starts
    `max` outside the venv (`No module named 'max'`).
    """
    broken = tmp_path / "no-config"
    shutil.copytree(gpt2_max_checkpoint, broken)
    (broken / "config.json").unlink()
    venv_bin = str(Path(sys.executable).parent)
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        entry for entry in env.get("PATH", "").split(os.pathsep) if entry != venv_bin
    )
    script = (
        "import sys, max.pipelines\n"
        "from gpt2_max.testing.server import assert_start_fails\n"
        "assert_start_fails(__import__('pathlib').Path(sys.argv[1]), 'No config.json')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(broken)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_paused_stops_the_whole_tree_and_resumes_it(tmp_path):
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & sleep 300 & echo started; wait"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    try:
        with leader.stdout:
            assert leader.stdout.readline() == b"started\n"
        tree = [psutil.Process(leader.pid), *psutil.Process(leader.pid).children()]
        assert len(tree) == 3
        served = server.Server(url="http://127.0.0.1:1", pid=leader.pid, log=tmp_path / "log")

        with served.paused():
            assert {p.status() for p in tree} == {psutil.STATUS_STOPPED}

        assert psutil.STATUS_STOPPED not in {p.status() for p in tree}
    finally:
        server.stop_process_group(leader)
