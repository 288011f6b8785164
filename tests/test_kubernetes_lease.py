"""The heartbeat lease of Kubernetes jobs, whose agent runs in the job's pod: a job waiting for GPUs
has no pod (none is created until the broker places it), and a placed job's pod may pull its image
for minutes before its agent starts. Neither is taken for a silent agent; a pod whose agent has
started and then goes silent is (the fake CoreV1 API of ``test_kubernetes.py``, a fake clock)."""

from __future__ import annotations

import pytest
from conftest import RESIZE_AT_ONCE, FakeClock
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
    broker.configure_pool(policy_params=RESIZE_AT_ONCE,
                          lease_s=60)
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


def test_a_pod_pending_past_startup_grace_fails_the_job_and_its_lease_is_no_longer_kept(lease_cluster):
    """A pod that never starts (unschedulable, an agent image that cannot be pulled, a volume that
    cannot be mounted) must not hold its GPUs forever through the backend's heartbeats."""
    from datetime import UTC, datetime, timedelta

    broker, backend, api, clock = lease_cluster
    job = submit(broker, "stuck", 4)
    backend.start(job)
    (pod,) = api.pods
    api.pods[pod].metadata.creation_timestamp = datetime.now(UTC) - timedelta(seconds=700)  # > 600 s
    beat_s = broker.job(job.id).last_heartbeat_s
    clock.advance(10)
    backend.sync(broker.job(job.id))
    assert broker.job(job.id).last_heartbeat_s == beat_s  # no longer kept
    problem = backend.problem(broker.job(job.id))
    assert problem is not None and "has been Pending for 7" in problem.reason and "startup_grace_s 600s" in problem.reason
    # the scheduler's word, where it has one (the pod goes through it: pinned by node affinity)
    from kubernetes.client import models as k8s

    message = "0/12 nodes are available: 1 Insufficient memory, 11 node(s) didn't match Pod's node affinity."
    api.pods[pod].status = k8s.V1PodStatus(phase="Pending", conditions=[k8s.V1PodCondition(
        type="PodScheduled", status="False", reason="Unschedulable", message=message)])
    assert backend.problem(broker.job(job.id)).reason.endswith(f"(startup_grace_s 600s): not scheduled: {message}")


def waiting_for(reason: str, message: str) -> object:
    """A Pending pod's status: its agent waits to start for ``reason`` (``message``)."""
    from kubernetes.client import models as k8s

    return k8s.V1PodStatus(phase="Pending", init_container_statuses=[k8s.V1ContainerStatus(
        name="elastic-agent", image="agent", image_id="", ready=False, restart_count=0,
        state=k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason=reason, message=message)))])


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
def test_an_image_pull_error_is_retried_within_startup_grace_and_named_past_it(lease_cluster, reason):
    """A registry's 429 or 503 passes, and the kubelet retries the pull with back-off: the job
    failed at the first poll that saw the error. The pod is starting (the lease kept) until
    ``startup_grace_s``; past it the job fails with the pull error as its reason."""
    from datetime import UTC, datetime, timedelta

    broker, backend, api, clock = lease_cluster
    job = submit(broker, "pulling", 4)
    backend.start(job)
    (pod,) = api.pods
    api.pods[pod].metadata.creation_timestamp = datetime.now(UTC) - timedelta(seconds=30)
    api.pods[pod].status = waiting_for(reason, "429 Too Many Requests")
    assert backend.problem(broker.job(job.id)) is None
    beat_s = broker.job(job.id).last_heartbeat_s
    clock.advance(10)
    backend.sync(broker.job(job.id))
    assert broker.job(job.id).last_heartbeat_s > beat_s  # still starting: the backend keeps the lease
    api.pods[pod].metadata.creation_timestamp = datetime.now(UTC) - timedelta(seconds=700)
    problem = backend.problem(broker.job(job.id))
    assert "Pending for 70" in problem.reason and "startup_grace_s 600s" in problem.reason
    assert f"elastic-agent container cannot start: {reason}: 429 Too Many Requests" in problem.reason


def test_an_invalid_image_name_fails_the_job_at_once(lease_cluster):
    """No retry makes an invalid image name pullable: a problem at the first poll, within the grace."""
    from datetime import UTC, datetime

    broker, backend, api, _clock = lease_cluster
    job = submit(broker, "typo", 4)
    backend.start(job)
    (pod,) = api.pods
    api.pods[pod].metadata.creation_timestamp = datetime.now(UTC)
    api.pods[pod].status = waiting_for("InvalidImageName", 'couldn\'t parse image name "Train:1"')
    assert "elastic-agent container cannot start: InvalidImageName" in backend.problem(broker.job(job.id)).reason


def test_a_gang_whose_pods_pull_their_images_keeps_its_lease(tmp_path):
    """The same for a gang of pods (one per node): none of its agents runs while its pods are
    Pending, and the backend keeps the lease meanwhile."""
    from test_kubernetes_gang import GANG, NODES, FakeCoreV1WithServices

    clock = FakeClock()
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", clock=clock)
    for node in NODES:
        broker.register_node(node, 4, gpu_type="NVIDIA A100")
    broker.configure_pool(lease_s=60)
    backend = KubernetesBackend(config(), broker, FakeCoreV1WithServices())
    job = broker.submit(JobSpec("gang", GANG, 8, 8, total_steps=1000, backend="kubernetes"))
    backend.start(job)
    for _ in range(12):  # two minutes, all its pods Pending
        clock.advance(10)
        backend.sync(broker.job(job.id))
        broker.rebalance()
    assert broker.job(job.id).status is JobStatus.RUNNING
    broker.engine.dispose()


def test_kube_sync_into_a_second_pool_registers_nothing_when_a_node_is_in_the_first(tmp_path):
    from kubernetes.client import models as k8s

    from airflow_elastic_gpu.backends.base import BackendError
    from airflow_elastic_gpu.backends.kubernetes import register_nodes_from_cluster

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    api = FakeCoreV1()
    api.nodes = [k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"nvidia.com/gpu.count": "8"}))
                 for name in ("a100-0", "a100-1")]
    broker.register_node("a100-1", 8, pool="first")
    with pytest.raises(BackendError, match=r"node\(s\) a100-1 are in another GPU pool already"):
        register_nodes_from_cluster(broker, api, pool="second")
    assert [n.name for n in broker.nodes()] == ["a100-1"]  # a100-0 was not registered either
    broker.engine.dispose()


def test_a_pod_made_again_and_again_keeps_the_lease_only_for_the_start_grace_of_its_generation(lease_cluster):
    """A pod bound to a node that no longer exists is deleted by the pod garbage collector within a
    minute, and the next sync makes it again (its generation is not acked): each new pod was
    "starting" for its own startup_grace_s, so the backend kept the job's lease for ever. The
    lease is kept for the start grace of the generation, from its publication."""
    broker, backend, api, clock = lease_cluster
    job = submit(broker, "pinned", 4)
    backend.start(job)
    published_s = broker.job(job.id).published_s
    for i in range(80):  # 800 s, past startup_grace_s (600) and the old pod's stop (120)
        clock.advance(10)
        if i % 4 == 3:
            for name in list(api.pods):  # PodGC, every 40 s: the node is gone
                del api.pods[name]
        backend.sync(broker.job(job.id))  # Pending (kept the lease), or made again
        broker.rebalance()
    assert clock() - published_s > 720
    assert broker.job(job.id).status is JobStatus.LOST  # its lease ran out: the GPUs go back


def test_a_single_pod_job_suspended_after_its_pod_was_deleted_frees_its_gpus_and_resumes(lease_cluster):
    """A preemptible job's pod is gone (deleted from outside, its node drained) when a short job
    suspends it: no agent is left to ack the generation without GPUs, so the backend acks it. It
    was never acked: the job held its four GPUs, the short job waited, and the lease ended the job
    LOST instead of suspending it."""
    broker, backend, api, clock = lease_cluster
    broker.configure_pool(policy_params={**RESIZE_AT_ONCE, "suspend": True, "min_runtime_s": 0.0})
    long = broker.submit(JobSpec("long", "python train.py", 1, 4, total_steps=100_000, backend="kubernetes",
                                 preemptible=True))
    backend.start(long)
    (pod,) = api.pods
    api.set_phase(pod, "Running")
    broker.ack(long.id, 1)
    api.delete_namespaced_pod(pod, "ml")
    short = submit(broker, "short", 4)
    suspended = broker.job(long.id)
    assert suspended.status is JobStatus.SUSPENDED and suspended.target_gpus == ()
    assert backend.sync(suspended) == "wait"
    assert broker.job(long.id).in_use_gpus == () and broker.job(long.id).acked_generation == 2
    assert len(broker.job(short.id).target_gpus) == 4
    for _ in range(12):  # two minutes, twice the lease: a suspended job has no agent to heartbeat
        clock.advance(10)
        broker.heartbeat(short.id)
        backend.sync(broker.job(long.id))
        broker.rebalance()
    assert broker.job(long.id).status is JobStatus.SUSPENDED
    broker.ack(short.id, 1)
    broker.finish(short.id)
    resumed = broker.job(long.id)
    assert resumed.status is JobStatus.RUNNING and len(resumed.target_gpus) == 4
    assert backend.sync(resumed) == "create" and len(api.pods) == 1  # the new pod resumes from the checkpoint
