"""A pod's trainer that finished while the broker's API was out of reach: its agent could not
report the clean exit before the pod's grace period ended, and the job was failed as gone, or
declared LOST and the task retried, its whole training redone from the last checkpoint. The pod's
log (the launcher's ``--echo``) tells a clean exit from a stop on request, which also exits 0."""

from __future__ import annotations

from dataclasses import dataclass

import kubernetes.client as k8s
import pytest
from test_kubernetes import FakeCoreV1, config, submit

from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.watcher import GONE_POLLS, JobWatcher

FINISHED = ('{"step": 1000}\n{"final": true, "accuracy": 0.97, "step": 1000}\n'
            + protocol.launcher_line("trainer exited with code 0"))
STOPPED = '{"step": 420}\n' + protocol.launcher_line("stopped on request")


@dataclass
class RawResponse:
    """What the client returns with ``_preload_content=False``: the body's bytes, unread."""

    data: bytes
    released: bool = False

    def release_conn(self) -> None:
        self.released = True


class LoggedCoreV1(FakeCoreV1):
    """:class:`FakeCoreV1` whose pods' trainer logs are set by the test, answered as the real client
    (kubernetes 36) answers: decoded by itself, ``str(bytes)``, one escaped line; raw, the bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, str] = {}
        self.responses: list[RawResponse] = []

    def read_namespaced_pod_log(self, name, namespace, container, tail_lines, limit_bytes=None,
                                _preload_content=True):
        # the kubelet's ReadLogs: from the first of the last tail_lines lines, at most limit_bytes on
        lines = self.logs.get(name, "").splitlines()
        body = "\n".join(lines[max(0, len(lines) - tail_lines):] if tail_lines else []).encode()[:limit_bytes]
        if _preload_content:
            return str(body)
        self.responses.append(RawResponse(body))
        return self.responses[-1]

    def trainer_exited(self, name: str, log: str) -> None:
        """The trainer container exited 0 (the launcher's code, clean exit or stop) with ``log``;
        its agent (a native sidecar) is gone too: the pod Succeeded."""
        self.logs[name] = log
        self.pods[name].status = k8s.V1PodStatus(phase="Succeeded", container_statuses=[k8s.V1ContainerStatus(
            name="trainer", image="i", image_id="", ready=False, restart_count=0,
            state=k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=0, reason="Completed")))])


@pytest.fixture
def cluster(tmp_path, clock):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", clock=clock)
    broker.register_node("gpu-node-0", 4, gpu_type="NVIDIA A100")
    api = LoggedCoreV1()
    yield broker, api, KubernetesBackend(config(), broker, api)
    broker.engine.dispose()


def started(broker, backend, api):
    job = submit(broker, "j", 1, 1)
    backend.start(job)
    broker.ack(job.id, 1)
    (name,) = api.pods
    return job, name


@pytest.mark.parametrize(("log", "succeeded"), [(FINISHED, True), (STOPPED, False),
                                                (("x" * 400 + "\n") * 300 + FINISHED, True)],
                         ids=["finished", "stopped", "finished after long lines"])
def test_a_clean_exit_that_its_agent_did_not_report_is_the_jobs_success(cluster, log, succeeded):
    broker, api, backend = cluster
    job, name = started(broker, backend, api)
    api.trainer_exited(name, log)
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS):
        watcher.poll()
    ended = broker.job(job.id)
    assert api.responses and all(r.released for r in api.responses)
    if succeeded:
        assert ended.status is JobStatus.SUCCEEDED and ended.metrics["accuracy"] == 0.97
    else:  # stopped on request: not a finished training (the lease or the agent's report decides)
        assert ended.status is JobStatus.RUNNING


def test_a_clean_exit_after_a_line_longer_than_the_log_limit_is_the_jobs_success(cluster):
    """The last lines alone over the byte limit (a metrics line of 70 KB): the tail went 200 -> 50
    -> 12 -> 3 -> 0 lines, and the kubelet answers 0 lines with nothing."""
    broker, api, backend = cluster
    job, name = started(broker, backend, api)
    api.trainer_exited(name, '{"final": true, "blob": "' + "x" * 70_000 + '"}\n'
                       + protocol.launcher_line("trainer exited with code 0"))
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS):
        watcher.poll()
    assert broker.job(job.id).status is JobStatus.SUCCEEDED


def test_a_job_declared_lost_whose_trainer_had_finished_succeeds(cluster, clock):
    broker, api, backend = cluster
    job, name = started(broker, backend, api)
    lease_s = broker.pool_config().lease_s
    clock.advance(lease_s * 0.6)
    broker.rebalance()  # a call within the lease (else the silence of every caller reads as an outage)
    clock.advance(lease_s * 0.6)
    broker.rebalance()  # its agent silent for a lease: LOST
    assert broker.job(job.id).status is JobStatus.LOST
    api.trainer_exited(name, FINISHED)
    polled, _ = JobWatcher(broker, backend, job.id).poll()
    assert polled.status is JobStatus.SUCCEEDED and polled.metrics["accuracy"] == 0.97
    assert api.pods == {}  # cleaned up as any ended job


def test_the_trainers_last_log_lines_are_read_as_lines(cluster):
    """The failure reason's "Last log lines" were one escaped line (``b'...\\n...'``): the client
    gives ``str(bytes)`` for this call."""
    broker, api, backend = cluster
    job, name = started(broker, backend, api)
    api.logs[name] = "step 10\nCUDA error: out of memory\n"
    assert backend.log_tail(job.id) == ["step 10", "CUDA error: out of memory"]


class GangCoreV1(LoggedCoreV1):
    """:class:`LoggedCoreV1` with the Service calls a gang needs."""

    def __init__(self) -> None:
        super().__init__()
        self.services: dict[str, object] = {}

    def create_namespaced_service(self, namespace, body):
        self.services[body.metadata.name] = body

    def delete_namespaced_service(self, name, namespace):
        self.services.pop(name, None)


def running_gang(tmp_path, clock=None):
    """A gang of two pods on two 4-GPU nodes, both nodes acked: ``(broker, api, backend, job)``."""
    from test_kubernetes_gang import GANG

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", **({"clock": clock} if clock else {}))
    for node in ("gpu-node-0", "gpu-node-1"):
        broker.register_node(node, 4, gpu_type="A100")
    api = GangCoreV1()
    backend = KubernetesBackend(config(), broker, api)
    job = broker.submit(JobSpec("g", GANG, 8, 8, total_steps=1000, backend="kubernetes"))
    backend.start(job)
    for node in ("gpu-node-0", "gpu-node-1"):
        broker.ack(job.id, 1, node=node)
    return broker, api, backend, job

@pytest.mark.parametrize("rank0_printed", [True, False])
def test_a_lost_gang_whose_trainers_had_all_finished_succeeds(tmp_path, clock, rank0_printed):
    """As for one pod: every node's trainer exited cleanly while the broker's API was out of reach,
    the job was declared LOST; the gang's pods were never read for a clean exit, so it stayed LOST
    and the task's retry trained the whole job again. A node stopped on request (also exit 0) is
    not a clean exit, and the job stays LOST."""
    broker, api, backend, job = running_gang(tmp_path, clock)
    for _ in range(2):  # the agents silent for a lease (the broker's API away): LOST
        clock.advance(broker.pool_config().lease_s * 0.6)
        broker.rebalance()
    assert broker.job(job.id).status is JobStatus.LOST
    rank0, other = sorted(api.pods)
    api.trainer_exited(rank0, FINISHED)
    api.trainer_exited(other, '{"step": 1000}\n' + protocol.launcher_line("trainer exited with code 0")
                       if rank0_printed else STOPPED)
    polled, _ = JobWatcher(broker, backend, job.id).poll()
    if rank0_printed:
        assert polled.status is JobStatus.SUCCEEDED and polled.metrics["accuracy"] == 0.97, polled.reason
    else:
        assert polled.status is JobStatus.LOST
    broker.engine.dispose()


@pytest.mark.parametrize("how", ["evicted", "gone from the API"])
def test_a_gang_whose_rank_0_pod_was_deleted_after_the_others_finished_is_no_success(tmp_path, how):
    """Node 1 exited cleanly and reported it; rank 0, evaluating before it prints the final metrics,
    had its pod evicted: the one pod left had a clean exit, and the gang was taken for finished
    (SUCCEEDED, with no metrics and no final model) rather than failed for its retry."""
    from datetime import UTC, datetime

    broker, api, backend, job = running_gang(tmp_path)
    rank0, other = sorted(api.pods)
    api.trainer_exited(other, '{"step": 1000}\n' + protocol.launcher_line("trainer exited with code 0"))
    broker.finish(job.id, 0, None, node="gpu-node-1")
    if how == "evicted":
        api.pods[rank0].metadata.deletion_timestamp = datetime.now(UTC)
    else:
        del api.pods[rank0]
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS):
        watcher.poll()
    assert broker.job(job.id).status is not JobStatus.SUCCEEDED
    broker.engine.dispose()
