"""A trainer's process that leaves its tree before the launcher sees it (a double fork, a daemonizing
helper; a worker whose parent died at once) is still the job's: the launcher is its subreaper, so
every stop and resize reaches it. It escaped them, ran on the GPU that the ack then freed, and
outlived the launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sidecar import wait_for

from airflow_elastic_gpu.sidecar import protocol

DETACHING_TRAINER = """\
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the helper, detached at once (double fork): re-parented before any scan
        open(sys.argv[1], "a").write(os.environ["CUDA_VISIBLE_DEVICES"] + " " + str(os.getpid()) + "\\n")
        time.sleep(120)
    os._exit(0)
os.wait()
while True:
    time.sleep(0.1)  # trains
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_a_detached_helper_of_the_trainer_is_stopped_with_it_at_a_resize_and_a_stop(tmp_path):
    shared, helpers = tmp_path / "job", tmp_path / "helpers.txt"
    shared.mkdir()
    trainer = tmp_path / "trainer.py"
    trainer.write_text(DETACHING_TRAINER)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    launcher = subprocess.Popen([sys.executable, "-m", "airflow_elastic_gpu.sidecar.launcher", "--shared-dir",
                                 str(shared), "--poll-s", "0.1", "--grace-s", "2", "--",
                                 f"{sys.executable} {trainer} {helpers}"])
    try:
        wait_for(lambda: helpers.exists() and helpers.read_text().count("\n") == 1, 60, "the first helper")
        (first,) = [int(line.split()[1]) for line in helpers.read_text().splitlines()]
        protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": False})  # GPU 0 -> 1
        wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("generation") == 2
                 and protocol.read_json(shared / protocol.STATUS)["state"] == protocol.RUNNING, 60, "generation 2")
        assert not protocol.pid_alive(first)  # gone before the new generation runs (the ack frees GPU 0)
        wait_for(lambda: helpers.read_text().count("\n") == 2, 60, "the second helper")
        second = int(helpers.read_text().splitlines()[1].split()[1])
        protocol.write_json(shared / "stop.json", {"time_s": time.time(), "why": "the test is over"})
        assert launcher.wait(60) == 0
        assert not protocol.pid_alive(second)
    finally:
        with contextlib.suppress(ProcessLookupError):
            launcher.kill()
        for pid in [int(e) for e in os.listdir("/proc") if e.isdigit()]:  # whatever is left of the trainer
            with contextlib.suppress(OSError):
                if str(trainer).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def test_a_python_without_ctypes_runs_the_launcher_without_the_subreaper(monkeypatch):
    """A Python built without libffi (some minimal images) has no ``ctypes``: the launcher died of
    the import before it wrote a status, and the trainer container crash-looped."""
    monkeypatch.setitem(sys.modules, "ctypes", None)
    assert protocol.become_subreaper() is False
