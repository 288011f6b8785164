"""The sidecar's hold on a trainer's processes, with real subprocesses: a pid that another process
has taken since is never signalled, a worker that ended is forgotten, a trainer whose launcher died
(or whose main thread has exited while another still runs) is killed before its GPUs are given
up, and a launcher that dies of an error takes its trainer with it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_sidecar import wait_for

from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent
from airflow_elastic_gpu.sidecar.launcher import Launcher
from airflow_elastic_gpu.states import JobStatus, Target


@pytest.fixture
def sleeper():
    """A process of no job (another job's trainer, another user's program), in a session of its own."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_recorded_workers_pid_that_another_process_has_now_is_never_signalled(tmp_path, sleeper):
    """A worker recorded with its start time ended, and its pid went to another process (pids wrap
    at ``pid_max``, quickly on a busy host): stopping the trainer leaves that process alone, where
    it was SIGKILLed, with its process group."""
    start = protocol.proc_stat(sleeper.pid)[1]
    launcher = Launcher(tmp_path, "true", grace_s=1.0, poll_s=0.05)
    launcher.tree, launcher.starts = [sleeper.pid], {sleeper.pid: start - 1}  # the worker started earlier
    launcher._kill_workers()
    time.sleep(0.2)
    assert sleeper.poll() is None and launcher.tree == []
    # the same process as recorded: killed
    launcher.tree, launcher.starts = [sleeper.pid], {sleeper.pid: start}
    launcher._kill_workers()
    assert sleeper.wait(5) == -signal.SIGKILL


def test_a_helper_process_that_ended_is_no_longer_among_the_trainers_workers(tmp_path):
    """A trainer that ran a short helper (a compiler, ``nvidia-smi``) and then trains alone: the
    helper is dropped from ``status.json``'s workers once it has ended (it stayed there for the
    whole generation, and a stop later signalled whatever had its pid by then)."""
    shared = tmp_path / "job"
    shared.mkdir()
    trainer = ("import subprocess, sys, time; subprocess.run([sys.executable, '-c', 'import time; time.sleep(1.5)']); "
               "time.sleep(300)")
    launcher = Launcher(shared, f"{sys.executable} -c {trainer!r}", grace_s=1.0, poll_s=0.05)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(launcher._run()), daemon=True)
    thread.start()
    status = lambda: protocol.read_json(shared / protocol.STATUS) or {}
    helper = wait_for(lambda: (status().get("workers") or [None])[0], 20, "the helper among the workers")
    assert status()["worker_starts"] == [protocol.proc_stat(helper)[1]]
    wait_for(lambda: status().get("workers") == [] and status().get("state") == protocol.RUNNING, 20,
             "the ended helper to be dropped")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": True})
    thread.join(30)
    assert done == [0]


class _CancelledJobBroker:
    """The broker of a cancelled job: it holds the job's GPUs until the agent reports the stop."""

    def __init__(self, trainer: subprocess.Popen | SimpleNamespace) -> None:
        self.trainer = trainer
        self.reports: list[tuple[str, bool]] = []  # (reason, was the trainer alive)

    def heartbeat(self, job_id):
        return Target(job_id, JobStatus.CANCELLED, 1, (GpuId("n", 0),), 60.0)

    def fail(self, job_id, reason, exit_code=None, metrics=None, **kw):
        self.reports.append((reason, protocol.pid_alive(self.trainer.pid)))

    def progress(self, *a, **k):
        return None


def test_a_trainer_whose_launcher_died_is_killed_before_its_stop_is_reported(tmp_path):
    """A job is cancelled after its launcher was killed (OOM, SIGKILL), its trainer running in a
    session of its own: the agent kills the trainer before it tells the broker the trainer stopped
    (which frees the GPUs at once). It took the dead launcher for a stopped trainer, and the
    broker gave the GPUs to another job while the trainer still ran on them."""
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        protocol.write_json(tmp_path / protocol.STATUS, {
            "generation": 1, "state": protocol.RUNNING, "pid": trainer.pid,
            "pid_start": protocol.proc_stat(trainer.pid)[1], "workers": [], "worker_starts": [], "fences": 0,
            "launcher_pid": dead.pid})
        broker = _CancelledJobBroker(trainer)
        assert Agent(broker, "job", tmp_path, launcher_pid=dead.pid, stop_timeout_s=5).run() == 0
        assert broker.reports and broker.reports[0][1] is False, broker.reports
        assert trainer.wait(5) == -signal.SIGKILL
    finally:
        trainer.kill()
        trainer.wait()


def test_a_stop_kills_a_launcher_stopped_by_sigstop_and_its_trainer(tmp_path):
    """A launcher stopped by SIGSTOP or a debugger neither stops its trainer nor fences it: the
    cancelled job's agent waited its whole stop time-out, then left the trainer running on GPUs
    the broker frees a lease later. The stop kills such a launcher and its trainer."""
    from test_sidecar import start_launcher

    shared = tmp_path / "job"
    launcher = start_launcher(shared, f"{sys.executable} -c 'import time; time.sleep(300)'")
    try:
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        pid = wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("pid"), 30, "the trainer")
        launcher.send_signal(signal.SIGSTOP)
        broker = _CancelledJobBroker(SimpleNamespace(pid=pid))
        started = time.monotonic()
        assert Agent(broker, "job", shared, launcher_pid=launcher.pid, stop_timeout_s=30).run() == 0
        assert time.monotonic() - started < 20  # not the whole stop time-out
        assert broker.reports and broker.reports[0][1] is False  # reported once the trainer was gone
        assert launcher.wait(5) == -signal.SIGKILL
    finally:
        launcher.kill()
        launcher.wait()


def test_a_stopped_process_that_took_a_launchers_pid_is_left_alone(tmp_path):
    """The launcher's pid was taken since by another process, stopped (a suspended shell job): the
    stop's SIGKILL of a frozen launcher checks the start time the agent recorded."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    # a second launcher of the job (a gang's), alive and not stopping: the job's launchers are not all gone
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        other.send_signal(signal.SIGSTOP)
        protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING, "pid": None})
        agent = Agent(_CancelledJobBroker(SimpleNamespace(pid=other.pid)), "job", tmp_path,
                      launcher_pid=[other.pid, live.pid], stop_timeout_s=4)
        agent.launcher_starts[other.pid] -= 1  # recorded for the launcher that had the pid before
        assert agent._stopped("a test") is False
        assert protocol.pid_alive(other.pid)
    finally:
        for proc in (other, live):
            proc.kill()
            proc.wait()


_LEADER_EXITS = """
import ctypes, os, threading
r, w = os.pipe()
threading.Thread(target=lambda: os.read(r, 1)).start()  # lives on, blocked, as a driver's teardown would
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the main thread (the thread-group leader) ends
"""


def test_a_process_whose_main_thread_exited_while_another_runs_is_alive(tmp_path):
    """A multithreaded worker whose leader thread has exited while another thread still runs (and
    may hold its GPU) shows as a zombie in ``/proc/<pid>/stat``: it is alive until every thread has
    gone. It was taken for gone, and the next generation started on its GPU."""
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        wait_for(lambda: protocol.proc_stat(proc.pid)[0] == "Z", 10, "the leader to exit")
        assert protocol.pid_alive(proc.pid)
        assert protocol.survivors([proc.pid], timeout_s=0.3) == [proc.pid]
        launcher = Launcher(tmp_path, "true", grace_s=1.0, poll_s=0.05)
        launcher.tree, launcher.starts = [proc.pid], {proc.pid: protocol.proc_stat(proc.pid)[1]}
        launcher._kill_workers()  # SIGKILLed and waited for
        assert not protocol.pid_alive(proc.pid) and launcher.tree == []
    finally:
        proc.kill()
        proc.wait()


def test_a_launcher_that_dies_of_an_error_kills_its_trainer_first(tmp_path, monkeypatch):
    """The disk is full when the launcher writes its status for a stop: it dies of the error, and
    its trainer (in a session of its own) died with it. It lived on after the launcher, on GPUs
    the broker hands to another job once the lease ends."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} -c 'import time; time.sleep(300)'", grace_s=5.0, poll_s=0.05)
    write = protocol.write_json
    write(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    errors: list[BaseException] = []
    monkeypatch.setattr(signal, "signal", lambda *_a: None)  # run() sets its handlers: the main thread's only
    monkeypatch.setattr(protocol, "become_subreaper", lambda: False)  # nor make the test process a subreaper

    def run() -> None:
        try:
            launcher.run()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("state") == protocol.RUNNING, 20,
             "the trainer to run")
    trainer = launcher.proc

    def disk_full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(protocol, "write_json", disk_full)
    write(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": True})
    thread.join(30)
    assert errors and isinstance(errors[0], OSError)
    assert trainer.wait(5) == -signal.SIGKILL


class _GangBroker:
    """A gang of pods whose generation 2 runs on node n0 only (node n1 was dropped)."""

    timeout_s = 10.0

    def __init__(self) -> None:
        self.failed: list[tuple[str, str | None]] = []

    def heartbeat(self, job_id):
        return Target(job_id, JobStatus.RUNNING, 2, (GpuId("n0", 0), GpuId("n0", 1)), 60.0)

    def ack(self, job_id, generation, node=None):
        return True

    def fail(self, job_id, reason, exit_code=None, metrics=None, node=None):
        self.failed.append((reason, node))

    def progress(self, *a, **k):
        return None


def test_an_agent_restarted_after_its_node_was_dropped_does_not_fail_the_gang(tmp_path):
    """A gang of pods dropped node n1 in generation 2; n1's agent had written it and restarted
    (the kubelet restarts a native sidecar). When the backend deletes n1's pod, its launcher says
    stopped: the pod was replaced, not stopped from outside. The restarted agent did not know its
    node was dropped, and failed the whole job."""
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 2, "gpus": [], "stop": False})
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 2, "state": protocol.SUSPENDED, "pid": None,
                                                     "workers": [], "fences": 0})

    def pod_deleted() -> None:
        time.sleep(1.0)
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 2, "state": protocol.STOPPED, "pid": None,
                                                         "workers": [], "fences": 0})

    threading.Thread(target=pod_deleted, daemon=True).start()
    broker = _GangBroker()
    agent = Agent(broker, "job", tmp_path, node="n1", host_node="n1", poll_s=0.2, end_report_timeout_s=1)
    assert agent.run() == 0
    assert broker.failed == [] and agent.dropped


class _GangBrokerOnThisHost:
    """A gang of launchers on this host (virtual nodes n0, n1) whose generation 1 runs."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def heartbeat(self, job_id):
        return Target(job_id, JobStatus.RUNNING, 1, (GpuId("n0", 0), GpuId("n1", 0)), 60.0)

    def ack(self, *a, **k):
        return True

    def fail(self, job_id, reason, *a, **k):
        self.failed.append(reason)

    def finish(self, *a, **k):
        return None

    def progress(self, *a, **k):
        return None


def test_a_gangs_dead_launcher_kills_the_orphans_it_recorded_and_no_exited_nodes_pid(tmp_path, sleeper):
    """Node n0's trainer exited cleanly long ago (its pid went to another process); then n1's
    launcher is killed: the agent kills n1's orphaned trainer, and leaves the process that now has
    n0's old pid alone. It signalled every node's pid without their start times."""
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    dead = [subprocess.Popen(["true"]) for _ in range(2)]
    for proc in dead:
        proc.wait()
    try:
        protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "stop": False})
        for rank, (node, state, proc) in enumerate([("n0", protocol.EXITED, sleeper), ("n1", protocol.RUNNING, trainer)]):
            node_dir = tmp_path / protocol.NODES / node
            node_dir.mkdir(parents=True)
            protocol.write_json(node_dir / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False,
                                                              "nnodes": 2, "node_rank": rank})
            start = protocol.proc_stat(proc.pid)[1] - (5 if node == "n0" else 0)  # n0's trainer started earlier
            protocol.write_json(node_dir / protocol.STATUS, {
                "generation": 1, "state": state, "exit_code": 0 if state == protocol.EXITED else None,
                "pid": proc.pid, "pid_start": start, "workers": [], "worker_starts": [], "fences": 0,
                "launcher_pid": dead[rank].pid})
        broker = _GangBrokerOnThisHost()
        agent = Agent(broker, "job", tmp_path, launcher_pid=[p.pid for p in dead], poll_s=0.2, stop_timeout_s=3,
                      end_report_timeout_s=1)
        agent.run()
        assert trainer.wait(5) == -signal.SIGKILL
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        trainer.kill()
        trainer.wait()


def test_a_worker_that_cannot_be_signalled_is_not_waited_for_for_ever(tmp_path, monkeypatch):
    """A recorded worker alive after SIGKILL that this user may not signal (EPERM: a setuid helper)
    is left, named in the log; the stop waited for it for ever. One that may be signalled is in the
    kernel (whatever its state letter: a zombie leader whose thread tears its device down) and is
    waited for."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 11  # no process can have it; plays the worker
    real_alive, real_stat, real_may = protocol.pid_alive, protocol.proc_stat, protocol.may_signal
    monkeypatch.setattr(protocol, "pid_alive", lambda p: True if p == pid else real_alive(p))
    monkeypatch.setattr(protocol, "proc_stat", lambda p: ("S", 77) if p == pid else real_stat(p))
    monkeypatch.setattr(protocol, "may_signal", lambda p: p != pid and real_may(p))
    launcher = Launcher(tmp_path, "true", grace_s=1.0, poll_s=0.05)
    launcher.tree, launcher.starts = [pid], {pid: 77}
    started = time.monotonic()
    launcher._kill_workers()
    assert time.monotonic() - started < 10 and launcher.tree == []
    assert f"process(es) [{pid}] alive after SIGKILL: they cannot be signalled" in (tmp_path / protocol.LOG).read_text()
