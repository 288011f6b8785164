"""Fencing with real processes: a trainer never runs on GPUs its job no longer holds.

The launcher stops its trainer on its own once its agent has had no confirmed contact with the
broker for the fence period (shorter than the broker's lease), and the agent never dies of a broker
answer. Each real-process test asserts from timestamps (the launcher's ``status.json``, the broker's
events) that the trainer and its workers were dead **before** the broker could hand its GPUs to
another job, and that no process is left (``/proc``). See ``docs/fencing.md``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import pytest
import uvicorn
from conftest import RESIZE_AT_ONCE
from test_sidecar import TRAINER, start_launcher, wait_for

from airflow_elastic_gpu.backends.local import BackendError, LocalBackend
from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.launcher import EXIT_FENCED

# ignores SIGTERM, like a trainer stuck in a collective; its worker runs in its own session, as
# torchrun's do, so only the launcher's process-tree kill reaches it
STUBBORN_TRAINER = """
import json, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c",
                  "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nwhile True: time.sleep(0.1)"],
                 start_new_session=True)
step = 0
while True:
    step += 1
    print(json.dumps({"step": step}), flush=True)
    time.sleep(0.1)
"""

NAN_TRAINER = """
import json, time
for step in range(1, 21):
    print(json.dumps({"step": step}), flush=True)
    time.sleep(0.05)
    if step == 5:
        print('{"step": NaN}', flush=True)
        print('{"step": Infinity}', flush=True)
        time.sleep(1.5)
    if step == 10:
        print('{"step": -1}', flush=True)  # finite, but the broker rejects it
        time.sleep(1.5)  # the latest line for a few agent polls: reported on its own
print(json.dumps({"final": True, "step": 20, "accuracy": 0.9, "loss": float("nan")}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the launcher alone


@pytest.fixture
def stubborn(tmp_path) -> Path:
    path = tmp_path / "stubborn.py"
    path.write_text(STUBBORN_TRAINER)
    return path


def write_lease(shared: Path, lease_s: float, fence_s: float, kill_s: float, agent_pid: int | None = None) -> float:
    now = time.time()
    protocol.write_json(shared / protocol.LEASE, {"contact_s": now, "lease_s": lease_s, "fence_s": fence_s,
                                                  "kill_s": kill_s, "generation": 1, "status": "running",
                                                  "agent_pid": agent_pid})
    return now


def trainer_pids(shared: Path) -> list[int]:
    """The trainer's pid and its workers', once the launcher has seen the worker."""
    status = wait_for(lambda: (s := protocol.read_json(shared / protocol.STATUS) or {}).get("workers") and s,
                      20, "the trainer and its worker")
    return [status["pid"], *status["workers"]]


def test_a_stale_lease_fences_the_whole_tree_by_the_kill_deadline_and_blocks_new_generations(tmp_path, stubborn):
    shared = tmp_path / "job"
    proc = start_launcher(shared, f"{sys.executable} {stubborn}", grace_s=10.0)
    try:
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        pids = trainer_pids(shared)
        contact = write_lease(shared, lease_s=3.0, fence_s=1.0, kill_s=2.0)  # arms the fence
        status = wait_for(lambda: (s := protocol.read_json(shared / protocol.STATUS))["state"] == protocol.FENCED
                          and s, 10, "the fence")
        # SIGTERM is ignored: SIGKILL at kill_s (2 s), not after the 10 s grace (11 s)
        assert 1.0 <= status["fenced_s"] - contact < 3.0
        assert not any(protocol.pid_alive(p) for p in pids)
        protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": False})
        time.sleep(1.0)
        assert protocol.read_json(shared / protocol.STATUS)["state"] == protocol.FENCED  # no start while stale
        write_lease(shared, lease_s=3.0, fence_s=1.0, kill_s=2.0)  # contact is back
        status = wait_for(lambda: (s := protocol.read_json(shared / protocol.STATUS))["state"] == protocol.RUNNING
                          and s, 10, "generation 2 to start")
        assert status["generation"] == 2 and status["restarts"] == 1 and status["fences"] == 1
    finally:
        kill_all(proc, shared)


def test_a_launcher_blocked_on_its_shared_directory_still_kills_the_trainer_by_the_kill_deadline(tmp_path,
                                                                                                  stubborn):
    """A hung network file system blocks the launcher's reads of lease.json (here: a FIFO with no
    writer, which blocks an open for reading just so): its watchdog kills the trainer by kill_s all
    the same, and the launcher, unblocked, takes that for a fence the agent may resume."""
    shared = tmp_path / "job"
    proc = start_launcher(shared, f"{sys.executable} {stubborn}", grace_s=10.0)
    hang = shared / "hang.fifo"
    try:
        write_lease(shared, lease_s=4.0, fence_s=2.0, kill_s=3.0)
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        pids = trainer_pids(shared)
        contact = write_lease(shared, lease_s=4.0, fence_s=2.0, kill_s=3.0)
        time.sleep(0.5)  # read by the launcher (it polls every 0.05 s)
        os.mkfifo(hang)
        os.link(hang, shared / "lease.fifo")
        os.replace(shared / "lease.fifo", shared / protocol.LEASE)  # the next read of the lease blocks
        wait_for(lambda: not any(protocol.pid_alive(p) for p in pids), 10, "the trainer's tree to be killed")
        assert time.time() - contact < 3.0 + 2.0  # by kill_s, give or take the polls
        # the main loop wrote nothing meanwhile: it is still blocked
        assert protocol.read_json(shared / protocol.STATUS)["state"] == protocol.RUNNING
        write_lease(shared, lease_s=4.0, fence_s=2.0, kill_s=3.0)  # contact is back (a regular file again)
        fd = os.open(hang, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless the launcher waits on it
        os.write(fd, json.dumps({"contact_s": time.time(), "lease_s": 4.0, "fence_s": 2.0,
                                 "kill_s": 3.0}).encode())
        os.close(fd)
        status = wait_for(lambda: (s := protocol.read_json(shared / protocol.STATUS))["state"] == protocol.FENCED
                          and s, 10, "the watchdog's kill taken for a fence")
        assert status["fences"] == 1 and status["exit_code"] is None
        assert "fenced by the watchdog" in (shared / protocol.LOG).read_text()
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False, "resume": 1})
        status = wait_for(lambda: (s := protocol.read_json(shared / protocol.STATUS))["state"] == protocol.RUNNING
                          and s, 10, "the fenced trainer to restart")
        assert status["generation"] == 1 and status["fences"] == 1 and proc.poll() is None
    finally:
        kill_all(proc, shared)


def kill_all(launcher: subprocess.Popen, shared: Path) -> None:
    """Kill a test's launcher and every process below it: frozen first (SIGSTOP), so that none
    starts a worker between the scan and the kill."""
    status = protocol.read_json(shared / protocol.STATUS) or {}
    roots = [p for p in [*protocol.descendants(launcher.pid), status.get("pid"), *(status.get("workers") or [])] if p]
    protocol.signal_processes(roots, signal.SIGSTOP)
    launcher.kill()
    launcher.wait()
    tree = set(roots).union(*(protocol.descendants(p) for p in roots))
    protocol.signal_processes(sorted(tree), signal.SIGKILL)


def test_a_fenced_launcher_whose_agent_is_gone_for_a_whole_lease_exits(tmp_path, trainer):
    shared = tmp_path / "job"
    dead = subprocess.Popen(["true"])
    dead.wait()
    proc = start_launcher(shared, f"{sys.executable} {trainer} x 100000", grace_s=30.0)
    try:
        write_lease(shared, lease_s=2.0, fence_s=1.0, kill_s=1.5, agent_pid=dead.pid)
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        assert proc.wait(20) == EXIT_FENCED
        status = protocol.read_json(shared / protocol.STATUS)
        assert status["state"] == protocol.FENCED and status["fences"] == 1
        assert f"the agent (pid {dead.pid}) has been gone" in (shared / protocol.LOG).read_text()
    finally:
        kill_all(proc, shared)


@pytest.fixture
def trainer(tmp_path) -> Path:
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER)
    return path


# ---------------------------------------------------------------- agent, launcher and broker


@pytest.fixture
def one_gpu(tmp_path):
    """A broker on a SQLite file with one GPU and a 3-second lease (fence 1.5 s, kill by 2 s)."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}")
    broker.register_node("localhost", 1)
    broker.configure_pool(lease_s=3.0, policy_params=RESIZE_AT_ONCE)
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=30.0)
    started: list[str] = []
    yield broker, backend, started
    for job_id in started:
        backend.stop(job_id, timeout_s=5)
    broker.engine.dispose()


class EagerReaper(threading.Thread):
    """The most eager broker possible: rebalances every 50 ms, so a silent job is declared LOST and
    its GPUs handed to the waiting job ``waiting`` the moment its lease ends."""

    def __init__(self, broker: GpuBroker, waiting: str) -> None:
        super().__init__(daemon=True)
        self.broker, self.waiting = broker, waiting
        self.done = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.broker.heartbeat(self.waiting)  # the waiting job's own agent, alive
                self.broker.rebalance()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return
            time.sleep(0.05)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join(10)
        assert not self.errors, self.errors


def assert_fenced_before_the_gpus_moved(broker: GpuBroker, lost_id: str, next_id: str, shared: Path,
                                        pids: list[int]) -> float:
    """The fenced trainer and its workers were dead before the broker declared its job LOST and
    before it published the job's GPUs to ``next_id``; none of them is left. The fence time."""
    status = protocol.read_json(shared / protocol.STATUS)
    assert status["fences"] == 1 and status["fenced_s"] is not None, status
    fenced_s = status["fenced_s"]
    lost = broker.job(lost_id)
    assert lost.status is JobStatus.LOST, lost.reason
    (lost_event,) = [e for e in broker.events(job_id=lost_id) if e.kind == "lost"]
    (handed,) = [e for e in broker.events(job_id=next_id) if e.kind == "start"]
    assert handed.data["gpus"] == ["localhost:0"]
    earliest_reuse = lost.last_heartbeat_s + 3.0  # the broker reaps only after its lease
    assert fenced_s < earliest_reuse <= lost_event.time_s <= handed.time_s, (
        fenced_s, earliest_reuse, lost_event.time_s, handed.time_s)
    assert not [p for p in pids if protocol.pid_alive(p)], "a fenced process is still alive"
    assert "fenced: the trainer and its workers are stopped" in (shared / protocol.LOG).read_text()
    return fenced_s


def test_a_killed_agent_s_trainer_is_fenced_before_its_gpus_go_to_another_job(one_gpu, stubborn):
    broker, backend, started = one_gpu
    job = broker.submit(JobSpec("orphan", f"{sys.executable} {stubborn}", 1, 1, total_steps=10**6))
    broker.start(job.id, backend.start(job))
    started.append(job.id)
    handle = backend.handle(job.id)
    wait_for(lambda: broker.job(job.id).acked_generation == 1, 30, "the job to run")
    pids = trainer_pids(handle.job_dir)
    waiting = broker.submit(JobSpec("next", "sleep 1000", 1, 1, total_steps=10))
    assert broker.job(waiting.id).target_gpus == ()  # the only GPU is the orphan's
    with EagerReaper(broker, waiting.id):
        os.kill(handle.agent_pid, signal.SIGKILL)
        wait_for(lambda: broker.job(waiting.id).target_gpus, 20, "the GPU to be handed to the next job")
    assert_fenced_before_the_gpus_moved(broker, job.id, waiting.id, handle.job_dir, pids)
    # nobody will resume it: the launcher exits a lease after its agent went away
    wait_for(lambda: not protocol.pid_alive(handle.launcher_pid), 15, "the abandoned launcher to exit")
    assert not backend.is_running(job.id)
    broker.cancel(waiting.id)


def test_a_restarted_agent_resumes_a_fenced_trainer_the_broker_still_runs(one_gpu, trainer):
    broker, backend, started = one_gpu
    # fence at 4 s, and 4 s more to restart the agent (its imports take seconds on a loaded machine) before
    # the lease ends; the trainer (0.05 s a step) must still run when the fence comes
    broker.configure_pool(lease_s=8.0)
    job = broker.submit(JobSpec("resumed", f"{sys.executable} {trainer} x 300", 1, 1, total_steps=300))
    broker.start(job.id, backend.start(job))
    started.append(job.id)
    handle = backend.handle(job.id)
    wait_for(lambda: broker.job(job.id).steps_done >= 3, 30, "progress")
    trainer_pid = protocol.read_json(handle.job_dir / protocol.STATUS)["pid"]
    os.kill(handle.agent_pid, signal.SIGKILL)
    wait_for(lambda: protocol.read_json(handle.job_dir / protocol.STATUS)["state"] == protocol.FENCED, 20, "fence")
    assert not protocol.pid_alive(trainer_pid)
    backend.start(job)  # a supervisor or the task's retry: a new agent for the same launcher
    again = backend.handle(job.id)
    assert again.launcher_pid == handle.launcher_pid and again.agent_pid != handle.agent_pid
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 60, "job end")
    assert done.status is JobStatus.SUCCEEDED, done.reason
    assert done.steps_done == 300
    status = protocol.read_json(handle.job_dir / protocol.STATUS)
    assert status["restarts"] == 1 and status["fences"] == 1
    log = (handle.job_dir / protocol.LOG).read_text()
    assert log.count("generation 1: starting") == 2 and "restarting the fenced trainer" in log


def test_a_trainer_printing_a_nan_step_does_not_kill_its_agent_and_the_job_finishes(one_gpu, tmp_path):
    broker, backend, started = one_gpu
    script = tmp_path / "nan.py"
    script.write_text(NAN_TRAINER)
    job = broker.submit(JobSpec("nan", f"{sys.executable} {script}", 1, 1, total_steps=20))
    broker.start(job.id, backend.start(job))
    started.append(job.id)
    handle = backend.handle(job.id)
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 60, "job end")
    agent_log = (handle.job_dir / "agent.log").read_text()
    assert done.status is JobStatus.SUCCEEDED, done.reason + agent_log[-3000:]
    assert done.steps_done == 20
    assert done.metrics == {"final": True, "step": 20, "accuracy": 0.9, "loss": None}
    assert "dropped a progress line with a non-finite step (nan)" in agent_log
    assert "rejected by the broker, dropped: step must be a finite number >= 0, got -1.0" in agent_log
    assert "Traceback" not in agent_log
    wait_for(lambda: not backend.is_running(job.id), 10, "the agent and launcher to exit")


class ApiServer:
    """The broker's HTTP API in a thread, stopped and started again on the same port."""

    def __init__(self, broker: GpuBroker) -> None:
        self.broker, self.port = broker, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.broker), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "API server to start")

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(10)
            self.server = None


def test_an_unreachable_broker_fences_the_trainer_and_a_lost_job_is_not_restarted(one_gpu, stubborn, tmp_path,
                                                                                 monkeypatch):
    broker, _, _ = one_gpu
    api = ApiServer(broker)
    api.start()
    # the agent can reach the broker only through the API: its DB URL leads nowhere
    backend = LocalBackend(tmp_path / "http-jobs", broker, broker_url="sqlite:////nonexistent/dir/broker.db",
                           poll_s=0.2, grace_s=30.0)
    try:
        job = broker.submit(JobSpec("cut-off", f"{sys.executable} {stubborn}", 1, 1, total_steps=10**6))
        # the agent inherits these (the trainer does not: its environment is scrubbed)
        monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_API", api.url)
        monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_JOB_TOKEN", job.token)
        broker.start(job.id, backend.start(job))
        handle = backend.handle(job.id)
        wait_for(lambda: broker.job(job.id).acked_generation == 1, 30, "the job to run")
        pids = trainer_pids(handle.job_dir)
        waiting = broker.submit(JobSpec("next", "sleep 1000", 1, 1, total_steps=10))
        with EagerReaper(broker, waiting.id):
            api.stop()  # the broker is unreachable for the agent, longer than the lease
            wait_for(lambda: broker.job(waiting.id).target_gpus, 20, "the GPU to be handed to the next job")
        assert protocol.pid_alive(handle.agent_pid)  # the agent rode out the outage
        assert_fenced_before_the_gpus_moved(broker, job.id, waiting.id, handle.job_dir, pids)
        api.start()  # contact returns: the agent learns the job is LOST and stops, never restarts it
        wait_for(lambda: not backend.is_running(job.id), 20, "the agent and launcher to exit")
        status = protocol.read_json(handle.job_dir / protocol.STATUS)
        assert status["state"] == protocol.STOPPED and status["restarts"] == 0
        assert (handle.job_dir / protocol.LOG).read_text().count("generation 1: starting") == 1
        assert "job is lost in the broker" in (handle.job_dir / "agent.log").read_text()
        broker.cancel(waiting.id)
    finally:
        backend.stop(job.id, timeout_s=5)
        api.stop()


def test_local_backend_refuses_a_fence_longer_than_the_pool_s_lease(one_gpu, trainer, tmp_path):
    broker, _, _ = one_gpu
    backend = LocalBackend(tmp_path / "jobs2", broker, fence_s=5.0)
    job = broker.submit(JobSpec("too-long", f"{sys.executable} {trainer} x 3", 1, 1, total_steps=3))
    with pytest.raises(BackendError, match="fence_s: fence_s=5 leaves no time"):
        backend.start(job)
    assert backend.handle(job.id) is None  # nothing was started


SLOW_STOPPING_TRAINER = """
import json, signal, sys, time
marker = sys.argv[1]
def stop(*_):
    time.sleep(1.5)  # a checkpoint that takes a while
    with open(marker, "w") as f:
        f.write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
step = 0
while True:
    print(json.dumps({"step": step}), flush=True)
    step += 1
    time.sleep(0.1)
"""


def test_a_cancelled_job_s_gpu_goes_to_the_next_job_only_once_its_trainer_has_stopped(one_gpu, tmp_path):
    """Cancel ends the job at once; its trainer still checkpoints for 1.5 s after the agent's next
    heartbeat. A broker rebalancing every 50 ms must not hand the GPU to the waiting job before
    the trainer is gone: the agent's report of the stop frees it (well before the lease)."""
    broker, backend, started = one_gpu
    broker.configure_pool(lease_s=10.0)
    script, marker = tmp_path / "slow_stop.py", tmp_path / "stopped_at"
    script.write_text(SLOW_STOPPING_TRAINER)
    job = broker.submit(JobSpec("cancelled", f"{sys.executable} {script} {marker}", 1, 1, total_steps=10**6))
    broker.start(job.id, backend.start(job))
    started.append(job.id)
    wait_for(lambda: broker.job(job.id).acked_generation == 1, 30, "the job to run")
    waiting = broker.submit(JobSpec("next", "sleep 1000", 1, 1, total_steps=10))
    with EagerReaper(broker, waiting.id):
        cancelled_s = broker.cancel(job.id).end_s
        assert broker.job(job.id).in_use_gpus == (GpuId("localhost", 0),)  # held while it stops
        wait_for(lambda: broker.job(waiting.id).target_gpus, 20, "the GPU to be handed to the next job")
    stopped_s = float(marker.read_text())
    (release,) = [e for e in broker.events(job_id=job.id) if e.kind == "release"]
    (handed,) = [e for e in broker.events(job_id=waiting.id) if e.kind == "start"]
    assert cancelled_s + 1.5 < stopped_s <= release.time_s <= handed.time_s < cancelled_s + 10.0, (
        cancelled_s, stopped_s, release.time_s, handed.time_s)
    assert "its trainer stopped" in release.message, release.message
    assert broker.job(job.id).status is JobStatus.CANCELLED and broker.job(job.id).in_use_gpus == ()
    broker.cancel(waiting.id)


def test_a_broker_database_restored_from_a_backup_stops_the_trainer_it_no_longer_knows(tmp_path, trainer):
    """The broker's database restored from a backup taken before the job moved to another GPU: the
    broker knows it on GPU 0 (generation 1) while its trainer runs on GPU 1 (generation 2), a GPU
    the broker may hand to another job. The agent stops the trainer and fails the job, naming why."""
    import sqlite3

    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}")
    broker.register_node("localhost", 2)
    broker.configure_pool(lease_s=3.0, policy_params=RESIZE_AT_ONCE)
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=30.0)
    job = broker.submit(JobSpec("restored", f"{sys.executable} {trainer} x 100000", 1, 1, total_steps=100000))
    broker.start(job.id, backend.start(job))
    try:
        handle = backend.handle(job.id)
        wait_for(lambda: broker.job(job.id).acked_generation == 1, 30, "the job to run")
        backup = sqlite3.connect(tmp_path / "backup.db")
        with sqlite3.connect(tmp_path / "broker.db") as live:
            live.backup(backup)
        (first,) = broker.job(job.id).in_use_gpus
        broker.set_gpus_healthy("localhost", [first.index], False)  # the job moves to the other GPU
        broker.rebalance()
        wait_for(lambda: broker.job(job.id).acked_generation == 2, 30, "the job to run on the other GPU")
        moved_pid = protocol.read_json(handle.job_dir / protocol.STATUS)["pid"]
        with sqlite3.connect(tmp_path / "broker.db") as live:
            backup.backup(live)  # the restore
        backup.close()
        ended = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 30, "the job's end")
        assert ended.status is JobStatus.FAILED and "went back from 2 to 1" in ended.reason, ended.reason
        assert not protocol.pid_alive(moved_pid), "the trainer on the GPU the broker forgot still runs"
        assert protocol.read_json(handle.job_dir / protocol.STATUS)["state"] == protocol.STOPPED
    finally:
        backend.stop(job.id, timeout_s=5)
        broker.engine.dispose()
