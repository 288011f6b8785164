"""The heartbeat lease of Kubernetes jobs, whose agent runs in the job's pod: a job waiting for GPUs
has no pod (none is created until the broker places it), and a placed job's pod may pull its image
for minutes before its agent starts. Neither is taken for a silent agent; a pod whose agent has
started and then goes silent is (the fake CoreV1 API of ``test_kubernetes.py``, a fake clock)."""

from __future__ import annotations

import pytest
from conftest import FakeClock
from test_kubernetes import FakeCoreV1, config

from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker, InvalidRequest
from airflow_elastic_gpu.broker.types import JobSpec


@pytest.fixture
def lease_cluster(tmp_path):
    clock = FakeClock()
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", clock=clock)
    broker.register_node("gpu-node-0", 4, gpu_type="NVIDIA A100")
    broker.configure_pool(policy_params={"hysteresis": 0.0, "min_resize_interval_s": 0.0}, lease_s=60)
    api = FakeCoreV1()
    yield broker, KubernetesBackend(config(), broker, api), api, clock
    broker.engine.dispose()


def submit(broker, name, gpus):
    return broker.submit(JobSpec(name, "python train.py", gpus, gpus, total_steps=1000, backend="kubernetes"))


def test_a_job_waiting_for_gpus_or_for_its_pod_to_start_is_not_lost_and_a_silent_agent_is(lease_cluster):
    broker, backend, api, clock = lease_cluster
    hog = submit(broker, "hog", 4)
    backend.start(hog)
    api.set_phase(next(iter(api.pods)), "Running")
    broker.ack(hog.id, 1)
    waiting = submit(broker, "waiting", 4)
    backend.start(waiting)  # no GPUs: no pod, so no agent to heartbeat
    for _ in range(10):  # 100 s: longer than the lease
        clock.advance(10)
        broker.heartbeat(hog.id)
        broker.rebalance()
    assert broker.job(waiting.id).status is JobStatus.QUEUED
    broker.finish(hog.id)
    before = set(api.pods)
    assert backend.sync(broker.job(waiting.id)) == "create"  # placed: its pod pulls the image, Pending
    (pod,) = set(api.pods) - before
    for _ in range(12):  # two minutes of image pull: the backend keeps the lease for the pod
        clock.advance(10)
        backend.sync(broker.job(waiting.id))
        broker.rebalance()
    assert broker.job(waiting.id).status is JobStatus.RUNNING
    api.set_phase(pod, "Running")
    for _ in range(7):  # its agent started, then went silent: lost after the lease
        clock.advance(10)
        backend.sync(broker.job(waiting.id))
        broker.rebalance()
    assert broker.job(waiting.id).status is JobStatus.LOST


def test_the_lease_is_not_shortened_under_jobs_that_hold_gpus(lease_cluster):
    """Their agents fence their trainers within the lease they were told: a shorter one would free
    GPUs a trainer may still use. Raising it is always allowed, lowering it once the pool is idle."""
    broker, _backend, _api, _clock = lease_cluster
    job = broker.submit(JobSpec("j", "python train.py", 1, 1, total_steps=10))
    broker.rebalance()
    with pytest.raises(InvalidRequest, match=r"lease_s can be lowered \(from 60s to 3s\) only while no job"):
        broker.configure_pool(lease_s=3)
    broker.configure_pool(lease_s=120)
    broker.finish(job.id)
    broker.configure_pool(lease_s=3)
    assert broker.job(job.id).status is JobStatus.SUCCEEDED
