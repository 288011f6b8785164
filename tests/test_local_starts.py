"""The local backend's starts and what waits for a job's processes, with real processes: a start
that raced the job's cancel, a start of a job another host runs from a shared work directory, a
trainer left running by its killed launcher (a checkpoint claim and a cleanup wait for it), a
relative checkpoint directory, node names that are no directory names, and a gang started again
after all its processes died."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import local_backend
from test_sidecar import wait_for

from airflow_elastic_gpu.backends import local_cleanup
from airflow_elastic_gpu.backends.base import BackendError, start_job
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.backends.local_processes import boot_id, kill_group
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.marks import marked_processes

SLEEPER = f"{sys.executable} -c 'import time; time.sleep(120)'"


@pytest.fixture
def local(tmp_path):
    """A broker with one GPU and a local backend whose stops wait 2 s."""
    yield from local_backend(tmp_path, gpus=1, grace_s=2, stop_timeout_s=3)


def trainer_of(backend: LocalBackend, job_id: str) -> int:
    job_dir = backend.job_dir(job_id)
    return wait_for(lambda: (s := protocol.read_json(job_dir / protocol.STATUS) or {}).get("state")
                    == protocol.RUNNING and s["pid"], 30, "the trainer")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode().split("=", 1) for v in raw if b"=" in v)


def test_a_start_that_raced_the_jobs_cancel_starts_nothing(local):
    """A second triggerer (or a try reattaching) read the job just before its cancel, and took the
    start lock just after the cancel's stop: it started a new launcher, which ran a trainer at once
    from the old desired.json and lease, on the GPU the broker had given to the next job."""
    broker, backend = local
    a = broker.submit(JobSpec("a", SLEEPER, 1, 1, total_steps=10))
    start_job(broker, backend, a)
    first = trainer_of(backend, a.id)
    stale = broker.job(a.id)
    broker.cancel(a.id)
    backend.stop(a.id)
    assert not protocol.pid_alive(first)
    with pytest.raises(BackendError, match="is cancelled: not started again"):
        backend.start(stale)
    assert marked_processes(a.id) == []


def test_a_start_of_a_job_another_host_runs_from_a_shared_work_dir_is_refused(local):
    """Two containers sharing the work directory: the other's pids are not seen here, so the start
    took them for dead and started a second agent and launcher, a second trainer on the job's GPUs."""
    broker, backend = local
    job = broker.submit(JobSpec("a", SLEEPER, 1, 1, total_steps=10))
    gone = [subprocess.Popen(["true"]) for _ in range(2)]
    for p in gone:
        p.wait()
    job_dir = backend.job_dir(job.id)
    job_dir.mkdir(parents=True, mode=0o700)
    handle = {"job_dir": str(job_dir), "agent_pid": gone[0].pid, "launcher_pid": gone[1].pid,
              "boot_id": boot_id(), "host": "other-container/0123456789abcdef/pid:[4026532000]"}
    protocol.write_json(job_dir / "handle.json", handle)
    with pytest.raises(BackendError, match="was started on host other-container"):
        backend.start(job)  # a view read before the other start recorded its reference
    assert marked_processes(job.id) == []


def test_a_trainer_its_killed_launcher_left_keeps_its_directories_and_dies_before_the_next_claim(local):
    """The agent and launcher killed together, the trainer (a session of its own) ran on: the job
    counted as not running, so a cleanup listed its directories and the task's next job claimed its
    checkpoint directory at once: two trainers writing one checkpoint, on one GPU."""
    broker, backend = local
    key = "dag/task/run/-1"
    a = broker.submit(JobSpec("a", SLEEPER, 1, 1, total_steps=10, key=key))
    start_job(broker, backend, a)
    orphan = trainer_of(backend, a.id)
    h = backend.handle(a.id)
    for pid in (h.agent_pid, h.launcher_pid):
        kill_group(pid)
    wait_for(lambda: not any(map(protocol.pid_alive, (h.agent_pid, h.launcher_pid))), 10, "their deaths")
    broker.fail(a.id, "lost: no heartbeat for the lease")
    assert protocol.pid_alive(orphan) and not backend.is_running(a.id) and backend.has_processes(a.id)
    assert local_cleanup.leftovers(broker, backend.work_dir, 0.0) == []
    b = broker.submit(JobSpec("b", SLEEPER, 1, 1, total_steps=10, key=key))  # the task's retry
    start_job(broker, backend, b)
    new = trainer_of(backend, b.id)
    assert environ(new)["ELASTIC_CHECKPOINT_DIR"] == str(backend.default_checkpoint_dir(broker.job(b.id)))
    assert not protocol.pid_alive(orphan), "the ended job's trainer was killed before the directory changed hands"


def test_a_relative_checkpoint_dir_is_refused_and_the_cli_makes_it_absolute(local, tmp_path, monkeypatch):
    """``~/ckpt`` made a directory named ``~`` where the check ran, and every process of the job
    (worker, triggerer, launcher) resolved a relative path from its own directory."""
    from airflow_elastic_gpu.cli_parsing import absolute_path

    _, backend = local
    monkeypatch.chdir(tmp_path)
    for relative in ("~/ckpt", "ckpt"):
        with pytest.raises(BackendError, match="must be an absolute path"):
            backend.check(SLEEPER, relative)
    assert not (tmp_path / "~").exists()
    assert absolute_path("ckpt") == str(tmp_path / "ckpt")
    assert absolute_path("~/ckpt") == os.path.expanduser("~/ckpt")


@pytest.mark.parametrize("name", ["a/.", "/tmp/x", ".", ".."])
def test_a_node_name_that_is_no_directory_name_is_refused(local, name):
    """A gang's launchers run in ``nodes/<node>``: ``a/.`` shared ``a``'s directory, and an absolute
    name put the launcher's files outside the job's private directory."""
    broker, _ = local
    with pytest.raises(InvalidRequest, match="may not contain '/' or be '.' or '..'"):
        broker.register_node(name, 1, pool="other")


def test_the_handle_of_a_started_job_records_this_host(local):
    """What the refusal above reads: a start here records this host, and a start again is idempotent."""
    broker, backend = local
    job = broker.submit(JobSpec("a", SLEEPER, 1, 1, total_steps=10))
    start_job(broker, backend, job)
    ref = json.loads(backend.start(broker.job(job.id)))
    assert ref["host"] and backend.handle(job.id).elsewhere is None


def test_a_gang_started_again_after_all_its_processes_died_runs(tmp_path):
    """A gang's agent, launchers and trainers all killed (an OOM of the cgroup) while the job ran on:
    the start deleted the launchers' old targets but not the agent's record of the generation it had
    written, so the new agent never wrote the generation again, and the launchers waited for ever
    while the agent kept the lease (the GPUs held)."""
    from test_gang import GANG_ARGS, STAND_IN_GANG_TRAINER, gang_setup

    broker, backend = gang_setup(tmp_path, grace_s=2)
    script = tmp_path / "t.py"
    script.write_text(STAND_IN_GANG_TRAINER)
    job = broker.submit(JobSpec("g", f"{sys.executable} {script} 100000 {GANG_ARGS}", 4, 4, total_steps=100000))
    broker.start(job.id, backend.start(job))

    def running() -> bool:
        pids = dict(backend.handle(job.id).node_pids)
        states = {d.name: protocol.read_json(d / protocol.STATUS) or {}
                  for d in (backend.job_dir(job.id) / protocol.NODES).glob("*")}
        return len(states) == 2 and all(s.get("state") == protocol.RUNNING and s.get("launcher_pid") == pids[n]
                                        for n, s in states.items())

    try:
        wait_for(running, 40, "the gang to run")
        for pid in marked_processes(job.id):
            kill_group(pid)
        wait_for(lambda: not backend.has_processes(job.id), 10, "every process of the job to die")
        assert not broker.job(job.id).status.terminal
        backend.start(broker.job(job.id))  # the task's retry reattaching: the whole gang again
        wait_for(running, 30, "the gang started again to run")
    finally:
        backend.stop(job.id, timeout_s=5)
        broker.engine.dispose()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:b?mode=memory&uri=true",
                                 "sqlite:///file::memory:?cache=shared&uri=true"])
def test_a_broker_in_memory_is_refused_before_a_job_is_submitted(tmp_path, url):
    """``run-local --broker-url sqlite://`` waited for ever: the job's agent, another process, opened
    an empty in-memory database of its own (``no such table: job``), and outlived the command."""
    from airflow_elastic_gpu.cli import main

    assert main(["--broker-url", url, "run-local", "--total-steps", "3", "--work-dir", str(tmp_path / "jobs"),
                 "--", sys.executable, "-c", "print(1)"]) == 2
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir()), "no job was started"
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    with pytest.raises(BackendError, match="is an in-memory SQLite database of this process"):
        LocalBackend(tmp_path / "jobs", broker, broker_url=url).check(f"{sys.executable} -c 'print(1)'", None)
    broker.engine.dispose()
