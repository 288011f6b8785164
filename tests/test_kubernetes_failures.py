"""The Kubernetes backend when a job's pod goes wrong: deleted from outside, or its agent container
cannot start while its trainer runs (a gang's pods: ``test_kubernetes_gang.py``)."""

from __future__ import annotations

import json

import kubernetes.client as k8s
import pytest
from kubernetes.client.exceptions import ApiException
from test_kubernetes import a_running_pod, cluster, config, submit  # noqa: F401 - cluster is a fixture

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.types import JobSpec


def test_a_pod_deleted_from_outside_is_not_made_again_and_its_job_is_failed(cluster):  # noqa: F811
    """``kubectl delete pod`` (or a node removed) takes the running pod of an acked generation: the
    next poll does not make it again (it did, every poll, and on a node that is gone each new pod
    stayed Pending with the job's lease kept), and the job fails with the reason."""
    from airflow_elastic_gpu.triggers.watcher import GONE_POLLS, JobWatcher

    broker, api, backend, job, name = a_running_pod(cluster)
    api.delete_namespaced_pod(name, "ml")
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS + 1):
        watcher.poll()
    assert api.pods == {}
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and "deleted from outside" in failed.reason
    # its GPU stays held: a force-deleted pod's containers may run on (its agent, if it does, hears the
    # job ended and reports the trainer stopped); without a report, the lease frees it
    assert held_gpus(broker, job.id)


def held_gpus(broker, job_id: str) -> list:
    """The GPUs of the pool still held for ``job_id`` after its end."""
    return [g for n in broker.nodes() for g in n.gpus if g.in_use_by == job_id]


def _agent_cannot_start_while_the_trainer_runs(api, name) -> None:
    """The kubelet restarted the agent (a native sidecar) and its image cannot be pulled now; the
    trainer container runs on."""
    api.pods[name].status = k8s.V1PodStatus(
        phase="Running",
        init_container_statuses=[k8s.V1ContainerStatus(
            name="elastic-agent", image="a", image_id="", ready=False, restart_count=1,
            state=k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(
                reason="ImagePullBackOff", message="Back-off pulling image")))],
        container_statuses=[k8s.V1ContainerStatus(
            name="trainer", image="t", image_id="", ready=True, restart_count=0,
            state=k8s.V1ContainerState(running=k8s.V1ContainerStateRunning()))])


def test_an_agent_that_cannot_start_while_its_trainer_runs_fails_the_job_with_its_gpus_held(cluster):  # noqa: F811
    """The job fails with the agent's reason, but its GPUs stay out of every allocation until the
    trainer has stopped (the lease passes: its launcher fences it without an agent). They went to
    the next job at once, while the trainer still ran on them."""
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, api, backend, job, name = a_running_pod(cluster, gpus=4)
    _agent_cannot_start_while_the_trainer_runs(api, name)
    problem = backend.problem(broker.job(job.id))
    assert "elastic-agent container cannot start: ImagePullBackOff" in problem.reason and problem.running
    JobWatcher(broker, backend, job.id).poll()
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and "ImagePullBackOff" in failed.reason
    assert len(failed.in_use_gpus) == 4  # held until the trainer has stopped
    assert {g.node for g in failed.in_use_gpus} == {api_node(broker, job.id)}


@pytest.mark.parametrize("phase", ["Running", "Pending"])
def test_an_agent_that_keeps_crashing_fails_the_job_naming_its_last_exit(cluster, phase):  # noqa: F811
    """The agent killed at its memory limit again and again (``CrashLoopBackOff``): the job ended
    LOST with no word of why, and a Pending pod of it kept the job's lease for ``startup_grace_s``.
    After :data:`AGENT_CRASHES` restarts it is the pod's problem; before, the kubelet may mend it."""
    from datetime import UTC, datetime, timedelta

    from airflow_elastic_gpu.backends.kubernetes_pods import AGENT_CRASHES, pod_state

    broker, api, backend, job, name = a_running_pod(cluster)

    def agent_crashed(restarts: int, ran_s: float = 5.0) -> None:
        end = datetime.now(UTC)
        api.pods[name].status = k8s.V1PodStatus(phase=phase, init_container_statuses=[k8s.V1ContainerStatus(
            name="elastic-agent", image="a", image_id="", ready=False, restart_count=restarts,
            state=k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason="CrashLoopBackOff")),
            last_state=k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(
                exit_code=137, reason="OOMKilled", started_at=end - timedelta(seconds=ran_s), finished_at=end)))])

    agent_crashed(AGENT_CRASHES - 1)
    assert backend.problem(broker.job(job.id)) is None
    agent_crashed(AGENT_CRASHES + 5, ran_s=3 * 86400)  # killed now and then over days: not a crash loop
    assert backend.problem(broker.job(job.id)) is None
    agent_crashed(AGENT_CRASHES)
    problem = backend.problem(broker.job(job.id))
    assert problem.reason == (f"elastic-agent container keeps crashing: OOMKilled (exit code 137), "
                              f"restarted {AGENT_CRASHES} times")
    assert not pod_state(api.pods[name]).starting(600.0)  # no longer kept alive as a pod starting


def api_node(broker, job_id) -> str:
    return broker.job(job_id).in_use_gpus[0].node


def test_a_job_whose_command_runs_on_one_node_is_never_spread_when_gpus_go_out_of_service(cluster):  # noqa: F811
    """A single-node job of up to 4 GPUs runs on 4; then each node has one GPU out of service. Its
    target of 4 was spread 3 + 1 over two nodes, which its command cannot run: the backend raised
    "spans nodes" at every poll while the trainer ran on in the unhealthy GPU, and the local
    backend would run two trainers of it. It is now kept to one node, at most its healthy GPUs."""
    from airflow_elastic_gpu.broker.types import JobSpec

    broker, api, _backend, job, _name = a_running_pod(cluster, gpus=1)
    job = broker.submit(JobSpec("single", "python train.py --gpus {num_gpus}", 1, 4, total_steps=100,
                                backend="kubernetes"))
    broker.cancel(broker.jobs()[0].id, "make room")
    api.terminated()
    broker.rebalance()
    assert len(broker.job(job.id).target_gpus) == 4
    broker.ack(job.id, broker.job(job.id).target_generation)
    for node in ("gpu-node-0", "gpu-node-1"):
        broker.set_gpus_healthy(node, [3], False)
    broker.rebalance()
    target = broker.job(job.id).target_gpus
    assert len({g.node for g in target}) == 1 and 1 <= len(target) <= 3 and all(g.index != 3 for g in target)
    # a gang's command may still be spread (the test below)


def test_a_job_the_broker_spreads_over_nodes_with_gpus_out_of_service_runs_as_a_gang(cluster):  # noqa: F811
    """Each node has one GPU out of service (kube-sync read it unhealthy): the broker takes a job of
    4 GPUs for a gang and places it 3 + 1 over two nodes, and the backend runs it as one (a pod per
    node). It counted every GPU of a node, took the job for a single pod and failed it at start
    ("spans nodes ... but is not larger than a node")."""
    from test_kubernetes_gang import GANG, FakeCoreV1WithServices

    from airflow_elastic_gpu.broker.types import JobSpec

    broker, _ = cluster
    api = FakeCoreV1WithServices()
    for node in ("gpu-node-0", "gpu-node-1"):
        broker.set_gpus_healthy(node, [3], False)
    job = broker.submit(JobSpec("j", GANG, 1, 4, total_steps=100, backend="kubernetes"))
    assert len({g.node for g in broker.job(job.id).target_gpus}) == 2
    backend = KubernetesBackend(config(), broker, api)
    backend.start(broker.job(job.id))
    assert backend.is_gang(broker.job(job.id)) and len(api.pods) == 2 and len(api.services) == 1
    assert broker.job(job.id).status is JobStatus.RUNNING


def test_a_started_jobs_next_pod_refused_by_the_api_fails_the_job_with_the_apis_message(cluster):  # noqa: F811
    """A resize re-creates the pod (``recreate``) and the API refuses the new one for good (403: an
    admission policy; an exceeded quota is tried again): the job fails with the API's message. The trigger retried the
    creation at every poll, the job held its GPUs with nothing on them, and it ended LOST ("no
    heartbeat") a lease later. A refusal at the first start fails the job too (``start_job``)."""
    from kubernetes.client.exceptions import ApiException

    from airflow_elastic_gpu.backends.base import start_job
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, api = cluster
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    hog = submit(broker, "hog", 4, 4)  # one node taken
    job = start_job(broker, backend, submit(broker, "j", 1, 4))
    broker.ack(job.id, 1)
    submit(broker, "newcomer", 2, 2)  # the job is shrunk: a new generation, a new pod
    assert hog.status is JobStatus.RUNNING
    assert broker.job(job.id).target_generation == 2

    refusals = []

    def refuse(message):
        refusal = ApiException(status=403, reason="Forbidden")
        refusal.body = json.dumps({"kind": "Status", "message": message})
        refusals.append(refusal)

    def create(namespace, body):
        raise refusals.pop(0)

    api.create_namespaced_pod = create
    refuse('pods "p" is forbidden: exceeded quota: gpu-pods')  # frees up as other pods end: tried again
    JobWatcher(broker, backend, job.id).poll()  # no pod of the new generation yet: not "deleted from outside"
    assert broker.job(job.id).status is JobStatus.RUNNING
    refuse('pods "p" is forbidden: violates PodSecurity "restricted:latest"')
    assert backend.sync(broker.job(job.id)) == "wait"
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED
    assert "cannot create pod" in failed.reason and '403 Forbidden: pods "p" is forbidden: violates PodSecurity' in failed.reason


def test_a_retried_tasks_start_makes_a_missing_pod_again(cluster):  # noqa: F811
    """The task's try stopped the job's pod but could not cancel the job (the broker was away); its
    next try reattaches: its start makes the pod again (the trainer resumes from its checkpoint),
    where only a poll takes a missing pod for one deleted from outside. If the API server cannot
    take it for a moment, the try fails and the job goes on for the next try (a poll would have
    failed the job as one whose pod was deleted)."""
    broker, api, backend, job, name = a_running_pod(cluster)
    api.delete_namespaced_pod(name, "ml")
    api.fail["create_namespaced_pod"] = 503  # busy for a moment: this try fails, the job goes on
    with pytest.raises(BackendError, match="the task's next try reattaches"):
        backend.start(broker.job(job.id))
    assert broker.job(job.id).status is JobStatus.RUNNING
    backend.start(broker.job(job.id))
    assert list(api.pods) == [name] and broker.job(job.id).status is JobStatus.RUNNING


def test_a_gangs_next_pod_refused_by_the_api_fails_the_job(tmp_path):
    """As for one pod: a gang's pod that the API refuses for good fails the job with its message."""
    from test_kubernetes_gang import FakeCoreV1WithServices, ack_all, submit_gang

    from airflow_elastic_gpu.backends.base import start_job
    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    for node in ("n0", "n1", "n2"):
        broker.register_node(node, 4)
    api = FakeCoreV1WithServices()
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    job = start_job(broker, backend, submit_gang(broker, 8, 12))
    ack_all(broker, job.id, 1, ["n0", "n1", "n2"])
    api.fail["create_namespaced_pod"] = 422
    broker.submit(JobSpec("newcomer", "python train.py", 4, 4, total_steps=10, backend="kubernetes"))
    for _ in range(3):  # the old pods go, then the new ones are made
        backend.sync(broker.job(job.id))
        if broker.job(job.id).status.terminal:
            break
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and "422" in failed.reason
    assert failed.in_use_gpus  # held until the other nodes' trainers have stopped
    broker.engine.dispose()


@pytest.mark.parametrize("error", [503, 429, "connection"])
def test_a_pod_the_api_server_cannot_take_for_a_moment_is_made_at_the_next_sync(cluster, error):  # noqa: F811
    """A 503, a 429 or a dropped connection at a job's first start: the job starts all the same and
    its pod is made at the next poll. It failed the job, and the task's try with it."""
    import urllib3

    from airflow_elastic_gpu.backends.base import start_job

    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    if error == "connection":
        create = api.create_namespaced_pod

        def once_unreachable(namespace, body):
            api.create_namespaced_pod = create
            raise urllib3.exceptions.MaxRetryError(None, "/api/v1/namespaces/ml/pods", "connection refused")

        api.create_namespaced_pod = once_unreachable
    else:
        api.fail["create_namespaced_pod"] = error
    job = start_job(broker, backend, submit(broker, "j", 1, 1))
    assert job.status is JobStatus.RUNNING and api.pods == {}
    assert backend.sync(broker.job(job.id)) == "create" and len(api.pods) == 1


def test_a_pod_that_a_quota_keeps_from_being_made_is_named_when_its_job_is_lost(tmp_path):
    """A first pod that a resource quota keeps out (403 "exceeded quota": tried again at every poll)
    is recorded with the broker once, as a ``backend`` event the task's log shows, and the job,
    LOST a lease later since no agent ever reported, names it: its reason said only "no heartbeat"."""
    from conftest import FakeClock
    from test_kubernetes import FakeCoreV1

    from airflow_elastic_gpu.backends.base import start_job
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.states import EventKind
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    clock = FakeClock()
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", clock=clock)
    try:
        broker.register_node("gpu-node-0", 4, gpu_type="NVIDIA A100")
        broker.configure_pool(lease_s=60)
        api = FakeCoreV1()

        def create(namespace, body):
            refusal = ApiException(status=403, reason="Forbidden")
            refusal.body = json.dumps({"kind": "Status", "message": 'pods "p" is forbidden: exceeded quota: gpu-pods'})
            raise refusal

        api.create_namespaced_pod = create
        backend = KubernetesBackend(config(), broker, api)
        job = start_job(broker, backend, submit(broker, "j", 1, 4))
        watcher = JobWatcher(broker, backend, job.id)
        for _ in range(3):
            clock.advance(5)
            watcher.poll()
        notes = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.BACKEND]
        assert len(notes) == 1 and "exceeded quota: gpu-pods" in notes[0].message
        assert broker.job(job.id).status is JobStatus.RUNNING and api.pods == {}
        for _ in range(4):  # rebalances every 15 s (a longer gap reads as an outage of the broker)
            clock.advance(15)
            broker.rebalance()
        lost = broker.job(job.id)
        assert lost.status is JobStatus.LOST and "no heartbeat" in lost.reason
        assert "the backend's last problem with it: cannot create pod" in lost.reason
        assert "exceeded quota: gpu-pods" in lost.reason
        assert not broker.note_problem(job.id, "later")  # an ended job: nothing recorded
    finally:
        broker.engine.dispose()


def test_a_gangs_service_is_made_once_and_deleted_by_a_new_backend_when_no_pod_was_made(tmp_path):
    """A gang's headless Service is created at its first sync only (a create each poll, answered
    409, before), and a backend new to the job (a restarted triggerer, the task's on_kill) deletes
    it on stop although none of the gang's pods was ever made (a quota): it leaked, as that
    backend told a gang only by its pods' labels."""
    from test_kubernetes_gang import FakeCoreV1WithServices, submit_gang

    from airflow_elastic_gpu.backends.base import start_job
    from airflow_elastic_gpu.backends.kubernetes_gang import service_name
    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        for node in ("n0", "n1", "n2"):
            broker.register_node(node, 4)
        api = FakeCoreV1WithServices()

        def quota(namespace, body):
            raise ApiException(status=403, reason="Forbidden: exceeded quota: gpu-pods")

        api.create_namespaced_pod = quota
        sent, create_service = [], api.create_namespaced_service
        api.create_namespaced_service = lambda namespace, body: (sent.append(body.metadata.name),
                                                                 create_service(namespace, body))
        backend = KubernetesBackend(config(), broker, api)
        job = start_job(broker, backend, submit_gang(broker, 8, 12))
        for _ in range(3):
            backend.sync(broker.job(job.id))
        assert api.pods == {} and list(api.services) == [service_name(job.id)]
        assert sent == [service_name(job.id)]  # one request, not one a poll
        broker.cancel(job.id, "no pod could be made")
        KubernetesBackend(config(), broker, api).stop(job.id)
        assert api.services == {} and api.secrets == {}
    finally:
        broker.engine.dispose()


@pytest.mark.parametrize("error", [403, "connection"])
def test_a_pod_listing_the_api_refuses_at_submit_fails_the_new_job_with_a_clear_error(cluster, error):  # noqa: F811
    """The task's first look at the job's pods fails (RBAC without ``list`` on pods, or no
    connection): the task fails with a BackendError that names the listing (the raw ApiException
    or urllib3 error escaped the operator's error handling), and the job, never started, is failed
    in the broker rather than left queued with no task to follow it."""
    import logging

    import urllib3

    from airflow_elastic_gpu.triggers.submit import submit_and_start

    broker, api = cluster

    def refuse(namespace, label_selector):
        if error == "connection":
            raise urllib3.exceptions.MaxRetryError(None, "/api/v1/namespaces/ml/pods", "connection refused")
        refusal = ApiException(status=403, reason="Forbidden")
        refusal.body = json.dumps({"kind": "Status", "message": 'pods is forbidden: cannot list resource "pods"'})
        raise refusal

    api.list_namespaced_pod = refuse
    backend = KubernetesBackend(config(), broker, api)
    spec = JobSpec("j", "python train.py", 1, 1, total_steps=10, backend="kubernetes", key="k", attempt="try-1")
    with pytest.raises(BackendError, match="cannot list job .*'s pods") as raised:
        submit_and_start(broker, backend, spec, env=None, labels={}, log=logging.getLogger("test"))
    if error == 403:
        assert 'cannot list resource "pods"' in str(raised.value)
    (job,) = broker.jobs()
    assert job.status is JobStatus.FAILED and "cannot list job" in job.reason


def test_a_stop_deletes_the_token_and_a_possible_service_while_the_broker_is_away(cluster):  # noqa: F811
    """A backend new to a job whose pods were never made asks the broker whether it is a gang; with
    the broker away (the very moment a task's on_kill could not cancel the job) the stop raised
    before it deleted the token Secret. It deletes both now (the Service may not exist: a 404)."""
    from airflow_elastic_gpu.broker.types import BrokerError

    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit(broker, "j", 1, 1)
    backend.core_v1.create_namespaced_secret("ml", backend.builder.secret(job.id, "token"))
    fresh = KubernetesBackend(config(), broker, api)

    def away(job_id):
        raise BrokerError("could not connect to the broker's database")

    fresh.broker = type("Away", (), {"job": staticmethod(away)})()
    api.delete_namespaced_service = lambda name, namespace: api.calls.append(("delete service", name))
    fresh.stop(job.id)
    assert api.secrets == {} and ("delete service", f"elastic-gpu-{job.id}") in api.calls


def test_a_start_in_another_namespace_than_the_jobs_pods_is_refused(cluster):  # noqa: F811
    """A DAG's namespace changed between two tries of a task that reattach to the same running job:
    the second try made a second pod in the new namespace, on the GPUs the first one's trainer uses."""
    broker, api = cluster
    job = submit(broker, "j", 1, 1)
    broker.start(job.id, KubernetesBackend(config(), broker, api).start(job))
    assert broker.job(job.id).backend_ref == f"kubernetes:ml/elastic-gpu-{job.id}"
    calls = list(api.calls)
    moved = KubernetesBackend(KubernetesJobConfig(**{**config().to_dict(), "namespace": "ml-prod"}), broker, api)
    with pytest.raises(BackendError, match="started in namespace 'ml' .*not in the configured namespace 'ml-prod'"):
        moved.start(broker.job(job.id))
    assert api.calls == calls  # no Secret, no pod made


def test_a_stop_tries_every_deletion_and_names_the_one_that_failed(tmp_path):
    """One pod's deletion answered 500: the stop raised at once, leaving the gang's other pods, its
    Service and its token Secret behind. All the rest is deleted now, and the error names the pod."""
    from test_kubernetes_gang import FakeCoreV1WithServices, ack_all, submit_gang

    from airflow_elastic_gpu.backends.kubernetes_gang import service_name
    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    for node in ("gpu-node-0", "gpu-node-1", "gpu-node-2"):
        broker.register_node(node, 4, gpu_type="NVIDIA A100")
    api = FakeCoreV1WithServices()
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, ("gpu-node-0", "gpu-node-1", "gpu-node-2"))
    first, *others = sorted(api.pods)
    api.fail["delete_namespaced_pod"] = 500  # the first deletion only
    with pytest.raises(BackendError, match=rf"cannot clean up all of job {job.id} .*cannot delete pod {first}: 500"):
        backend.stop(job.id)
    assert list(api.pods) == [first] and len(others) == 2
    assert api.services == {} and api.secrets == {}
    assert ("delete service", service_name(job.id)) in api.calls
    broker.engine.dispose()


def test_a_call_to_an_api_server_that_never_answers_times_out():
    """The Kubernetes client sets no time-out: a call to an API server that accepted the connection
    and never answered waited for ever (a trigger's poll, a worker's wait, ``nodes kube-sync``).
    The real client, against a socket that accepts and stays silent."""
    import socket
    import time as clock

    from kubernetes import client

    from airflow_elastic_gpu.backends.kubernetes_config import with_request_timeout

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        config = client.Configuration()
        config.host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        core_v1 = with_request_timeout(client.CoreV1Api(client.ApiClient(config)), (1.0, 1.0))
        started = clock.monotonic()
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            core_v1.list_namespaced_pod("default")
        assert clock.monotonic() - started < 20
    finally:
        silent.close()


def test_a_retried_start_replaces_its_token_secret_in_a_namespace_at_its_secrets_quota(cluster):  # noqa: F811
    """A namespace at its ``secrets`` quota answers a create of the Secret an earlier try made with
    403 "exceeded quota" (quota admission before the existence check), not 409: the retried start
    failed; it now replaces the Secret, and a 403 with no Secret to replace is still an error."""
    broker, api = cluster
    job = submit(broker, "j", 1, 1)
    over = ApiException(status=403, reason="Forbidden")
    over.body = '{"message": "secrets \\"elastic-gpu-token-x\\" is forbidden: exceeded quota: q"}'

    def refused(namespace, body):
        raise over

    real_replace = api.replace_namespaced_secret

    def replace(name, namespace, body):  # the real API: 404 for a Secret that does not exist
        if name not in api.secrets:
            raise ApiException(status=404, reason="NotFound")
        real_replace(name, namespace, body)

    api.replace_namespaced_secret, api.create_namespaced_secret = replace, refused
    with pytest.raises(BackendError, match="exceeded quota.*none to replace: 404"):
        KubernetesBackend(config(), broker, api).start(job)
    api.secrets["elastic-gpu-token-" + job.id] = k8s.V1Secret()  # the earlier try's Secret
    KubernetesBackend(config(), broker, api).start(job)
    assert api.pods and api.secrets["elastic-gpu-token-" + job.id].metadata is not None
