"""The local backend on a distributed Airflow: a job is followed, stopped and started again only on
the host it was started on. A trigger moved to another machine's triggerer, or a retry on another
worker, saw no processes of the job there (no job directory; or, on a shared work directory,
another boot's pids): after three polls it failed a healthy training as "gone", and a retry there
started a second trainer of it."""

from __future__ import annotations

import re

import pytest
from test_local_backend import local  # noqa: F401 - a fixture
from test_local_processes import SLEEPER, marked
from test_sidecar import wait_for

from airflow_elastic_gpu.backends import BackendError, local_processes
from airflow_elastic_gpu.backends.base import start_job
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.submit import submit_and_start
from airflow_elastic_gpu.triggers.watcher import GONE_POLLS, JobWatcher


@pytest.mark.parametrize("shared_work_dir", [False, True], ids=["own work directory", "shared work directory"])
def test_another_hosts_trigger_and_retry_leave_a_running_job_to_its_host(local, tmp_path, monkeypatch,  # noqa: F811
                                                                         shared_work_dir):
    import logging

    broker, backend = local
    job = start_job(broker, backend, broker.submit(JobSpec("j", SLEEPER, 1, 1, total_steps=10, key="d/t/r/-1")))
    wait_for(lambda: backend.handle(job.id) is not None and len(marked(job.id)) >= 2, 60, "the job to start")
    running, here = set(marked(job.id)), local_processes.host_id()
    assert local_processes.started_elsewhere(broker.job(job.id).backend_ref) is None  # its own host
    monkeypatch.setattr(local_processes, "host_id", lambda: "gpu-host-b")  # from now on: another machine
    other = backend if shared_work_dir else LocalBackend(tmp_path / "host-b-jobs", broker)
    watcher = JobWatcher(broker, other, job.id)
    for _ in range(GONE_POLLS + 1):
        seen, _ = watcher.poll()
    assert seen.status is JobStatus.RUNNING and other.problem(seen) is None
    spec = JobSpec("j", SLEEPER, 1, 1, total_steps=10, key="d/t/r/-1")  # a retry's submit: the key's job
    started = submit_and_start(broker, other, spec, env=None, labels={}, log=logging.getLogger("test"))
    assert started.reattached and started.job.id == job.id  # followed from here, as its trigger follows it
    assert set(marked(job.id)) == running  # nothing started from here
    with pytest.raises(BackendError, match=re.escape(f"started on host {here}, not this one (gpu-host-b)")):
        other.start(broker.job(job.id))  # run-local --key there: refused, naming both
    if not shared_work_dir:  # the task's stop from there neither kills nor reports the processes of host A
        other.stop(job.id, timeout_s=1)
        after = broker.job(job.id)
        assert running <= set(marked(job.id))
        assert after.status is JobStatus.RUNNING and (after.in_use_gpus or after.target_gpus)
