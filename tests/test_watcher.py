"""The job watcher that the trigger and the operator's ``deferrable=False`` path share, and the
backend protocol it drives."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from airflow_elastic_gpu.backends import Backend, BackendError, backend_settings, make_backend
from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.backends.local_processes import JOB_MARK
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec, JobView
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.watcher import GONE_POLLS, JobWatcher


@pytest.fixture
def broker(tmp_path):
    b = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}")
    b.register_node("localhost", 2)
    yield b
    b.engine.dispose()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def started_with(backend: LocalBackend, broker: GpuBroker, job: JobView, agent_pid: int,
                 launcher_pid: int) -> None:
    """Record ``job`` as started by ``backend`` with these pids, as ``LocalBackend.start`` does,
    with a trainer log of two lines."""
    job_dir = backend.job_dir(job.id)
    job_dir.mkdir(parents=True)
    handle = {"job_dir": str(job_dir), "agent_pid": agent_pid, "launcher_pid": launcher_pid}
    protocol.write_json(job_dir / "handle.json", handle)
    (job_dir / protocol.LOG).write_text("step 1\nstep 2\n")
    broker.start(job.id, json.dumps(handle))


def test_the_watcher_fails_a_local_job_whose_processes_are_gone_with_the_reason_and_last_log_lines(
        tmp_path, broker, caplog):
    backend = LocalBackend(tmp_path / "jobs", broker)
    job = broker.submit(JobSpec("ghost", "python train.py", 1, 2, total_steps=100))
    started_with(backend, broker, job, dead_pid(), dead_pid())
    watcher = JobWatcher(broker, backend, job.id, log=logging.getLogger("task"))
    for _ in range(GONE_POLLS - 1):  # processes may be between states for a moment: not failed yet
        assert watcher.poll()[0].status is JobStatus.RUNNING
    with caplog.at_level(logging.INFO, logger="task"):
        ended, events = watcher.poll()
    assert ended.status is JobStatus.FAILED and ended.in_use_gpus == () and ended.target_gpus == ()
    assert "agent and launcher processes are gone" in ended.reason
    assert ended.reason.endswith("Last log lines:\nstep 1\nstep 2")
    assert [e.kind for e in events][-1] == "failed"
    assert "[failed] the job's agent and launcher processes are gone" in caplog.text


def test_the_watcher_counts_only_polls_in_a_row_that_find_the_processes_gone(tmp_path, broker):
    backend = LocalBackend(tmp_path / "jobs", broker)
    job = broker.submit(JobSpec("flicker", "python train.py", 1, 2, total_steps=100))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env={**os.environ, JOB_MARK: job.id})  # a process of this job
    try:
        started_with(backend, broker, job, dead_pid(), dead_pid())
        watcher = JobWatcher(broker, backend, job.id)
        for _ in range(GONE_POLLS - 1):
            watcher.poll()
        protocol.write_json(backend.job_dir(job.id) / "handle.json",  # a new agent, e.g. a task retry
                            {"job_dir": str(backend.job_dir(job.id)), "agent_pid": alive.pid,
                             "launcher_pid": dead_pid()})
        assert watcher.poll()[0].status is JobStatus.RUNNING and watcher.gone_polls == 0
        alive.kill()
        alive.wait()
        for _ in range(GONE_POLLS - 1):
            assert watcher.poll()[0].status is JobStatus.RUNNING
        assert watcher.poll()[0].status is JobStatus.FAILED
    finally:
        alive.kill()


def test_a_job_not_started_yet_is_not_judged_by_its_processes(tmp_path, broker):
    backend = LocalBackend(tmp_path / "jobs", broker)
    job = broker.submit(JobSpec("submitted", "python train.py", 1, 2, total_steps=100))
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS + 1):  # between submit and start (the operator's next call)
        assert watcher.poll()[0].status is JobStatus.RUNNING


def test_both_backends_implement_the_protocol_and_come_from_one_factory(tmp_path, broker):
    local = make_backend("local", broker=broker, work_dir=tmp_path)
    settings = backend_settings("kubernetes", image="train:1")
    pods = make_backend("kubernetes", broker=broker, kubernetes=settings)
    assert isinstance(local, LocalBackend) and isinstance(local, Backend) and local.name == "local"
    assert isinstance(pods, KubernetesBackend) and isinstance(pods, Backend) and pods.name == "kubernetes"
    with pytest.raises(BackendError, match="backend must be one of"):
        make_backend("slurm", broker=broker)
    with pytest.raises(BackendError, match="needs pod settings"):
        make_backend("kubernetes", broker=broker)
    with pytest.raises(BackendError, match="apply to backend='kubernetes' only"):
        backend_settings("local", image="train:1")
    with pytest.raises(BackendError, match="unexpected keyword argument 'namespaces'"):
        backend_settings("kubernetes", image="train:1", kubernetes={"namespaces": "ml"})


def test_a_renewed_watcher_goes_on_where_the_failed_one_left_off(tmp_path, broker):
    """After a failed poll the trigger and the operator renew their watcher (new clients): its event
    cursor, its polls that found the processes gone and its failed clean-ups carry over, so that
    the job's end is reported after CLEANUP_TRIES failed clean-ups in all, renewals or not."""
    from airflow_elastic_gpu.triggers.watcher import CLEANUP_TRIES, CleanupFailed

    backend = LocalBackend(tmp_path / "jobs", broker)
    job = broker.submit(JobSpec("renewed", "python train.py", 1, 2, total_steps=100))
    watcher = JobWatcher(broker, backend, job.id)
    watcher.poll()
    watcher.gone_polls = 1
    broker.cancel(job.id)
    failed = CleanupFailed(broker.job(job.id), OSError(30, "Read-only file system"))
    for _ in range(CLEANUP_TRIES - 1):
        assert not watcher.cleanup_failed(failed)
        watcher = watcher.renewed(broker, LocalBackend(tmp_path / "jobs", broker))
    assert watcher.cleanup_failed(failed)
    assert watcher.gone_polls == 1 and watcher.after_event_id > 0 and watcher.job_id == job.id
