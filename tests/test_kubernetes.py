"""Kubernetes backend: a job's whole life against a fake of the CoreV1 API (no cluster here), and
the helpers the other Kubernetes tests share (the strict schema check, a config, a fake API);
the manifests themselves: ``test_kubernetes_manifests.py``."""

from __future__ import annotations

import copy
import http.server
import json
import threading

import kubernetes_validate
import pytest
from conftest import RESIZE_AT_ONCE
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.backends.kubernetes import (
    KubernetesBackend,
    KubernetesJobConfig,
    register_nodes_from_cluster,
)
from airflow_elastic_gpu.backends.kubernetes_pods import pod_node
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar.http_transport import BrokerRejected, HttpBrokerTransport

K8S_VERSION = "1.33.0"
CONTEXT = {"dag_id": "nightly_retraining", "task_id": "train", "run_id": "scheduled__2026-11-23T00:00:00+00:00",
           "map_index": "2"}


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def config(**kw) -> KubernetesJobConfig:
    return KubernetesJobConfig(image="registry.example/train:1", broker_api_url="http://broker:8793",
                               namespace="ml", **kw)


class Listing:
    def __init__(self, items):
        self.items = items


class FakeCoreV1:
    """The CoreV1Api calls the backend makes, on dicts; ``fail`` injects API errors by method name."""

    def __init__(self) -> None:
        self.pods: dict[str, k8s.V1Pod] = {}
        self.secrets: dict[str, k8s.V1Secret] = {}
        self.nodes: list[k8s.V1Node] = []
        self.fail: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.graceful = False  # deletions take effect at once unless set
        self.listed = 0  # pod listings (each one a request to the API server)

    def _maybe_fail(self, method: str) -> None:
        status = self.fail.pop(method, None)
        if status:
            raise ApiException(status=status, reason="injected")

    def create_namespaced_secret(self, namespace, body):
        self._maybe_fail("create_namespaced_secret")
        if body.metadata.name in self.secrets:
            raise ApiException(status=409, reason="AlreadyExists")
        self.calls.append(("create secret", body.metadata.name))
        self.secrets[body.metadata.name] = copy.deepcopy(body)

    def replace_namespaced_secret(self, name, namespace, body):
        self.secrets[name] = copy.deepcopy(body)

    def delete_namespaced_secret(self, name, namespace):
        self._maybe_fail("delete_namespaced_secret")
        if self.secrets.pop(name, None) is None:
            raise ApiException(status=404, reason="NotFound")
        self.calls.append(("delete secret", name))

    def create_namespaced_pod(self, namespace, body):
        self._maybe_fail("create_namespaced_pod")
        if body.metadata.name in self.pods:
            raise ApiException(status=409, reason="AlreadyExists")
        pod = copy.deepcopy(body)
        pod.status = k8s.V1PodStatus(phase="Pending")
        self.pods[pod.metadata.name] = pod
        self.calls.append(("create pod", pod.metadata.name))

    def delete_namespaced_pod(self, name, namespace):
        self._maybe_fail("delete_namespaced_pod")
        if name not in self.pods:
            raise ApiException(status=404, reason="NotFound")
        if self.graceful:  # like a real API server: terminating (its grace period) until terminated()
            self.pods[name].metadata.deletion_timestamp = self.pods[name].metadata.deletion_timestamp or "now"
        else:
            del self.pods[name]
        self.calls.append(("delete pod", name))

    def terminated(self) -> None:
        """The deleted pods' containers have ended: the pods are gone."""
        for name in [n for n, p in self.pods.items() if p.metadata.deletion_timestamp]:
            del self.pods[name]

    def list_namespaced_pod(self, namespace, label_selector):
        self._maybe_fail("list_namespaced_pod")
        self.listed += 1
        key, value = label_selector.split("=", 1)
        return Listing([p for p in self.pods.values() if (p.metadata.labels or {}).get(key) == value])

    def read_namespaced_pod_log(self, name, namespace, container, tail_lines, **_kw):
        return "step 10\nCUDA error: out of memory\n"

    def list_node(self, label_selector=None):
        return Listing(self.nodes)

    # what the kubelet / someone else does
    def set_phase(self, name, phase, reason=None, message=None):
        self.pods[name].status = k8s.V1PodStatus(phase=phase, reason=reason, message=message)

    def oom(self, name):
        self.pods[name].status = k8s.V1PodStatus(phase="Running", container_statuses=[k8s.V1ContainerStatus(
            name="trainer", image="i", image_id="", ready=False, restart_count=0,
            state=k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled")))])


@pytest.fixture
def cluster(tmp_path):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    for node in ("gpu-node-0", "gpu-node-1"):
        broker.register_node(node, 4, gpu_type="NVIDIA A100")
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    api = FakeCoreV1()
    yield broker, api
    broker.engine.dispose()


def submit(broker, name, lo, hi, key=None):
    return broker.submit(JobSpec(name, "python train.py", lo, hi, total_steps=1000, backend="kubernetes", key=key))


def test_in_place_life_submit_start_resize_finish_cleanup(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    a = submit(broker, "a", 1, 4)
    ref = backend.start(a, context=CONTEXT)
    assert ref.startswith("kubernetes:ml/")
    (pod_name,) = api.pods
    pod = api.pods[pod_name]
    assert pod_node(pod) == next(iter({g.node for g in broker.job(a.id).target_gpus}))
    assert api.secrets  # the token Secret exists; its token authenticates this job only
    token = api.secrets[f"elastic-gpu-token-{a.id}"].string_data["token"]
    assert broker.verify_token(a.id, token) and not broker.verify_token(a.id, a.token)  # rotated at start
    broker.ack(a.id, 1)
    api.set_phase(pod_name, "Running")
    b = submit(broker, "b", 1, 4)  # a shrinks in place on its node for b (b fits on the other node)
    assert backend.sync(broker.job(a.id)) == "keep"
    assert list(api.pods) == [pod_name]  # same pod: the sidecar restarts the trainer inside it
    assert backend.problem(broker.job(a.id)) is None and backend.is_running(a.id)
    broker.finish(a.id)
    backend.stop(a.id, succeeded=True)
    assert api.pods == {} and f"elastic-gpu-token-{a.id}" not in api.secrets
    broker.cancel(b.id)


def test_recreate_mode_deletes_the_pod_and_creates_one_per_generation(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    big = submit(broker, "big", 1, 4)
    backend.start(big)
    broker.ack(big.id, 1)
    first = next(iter(api.pods))
    assert first.endswith("-g1")
    submit(broker, "x", 4, 4)  # takes the other node
    submit(broker, "y", 2, 2)  # big must shrink on its node to make room
    assert broker.job(big.id).target_generation == 2
    assert backend.sync(broker.job(big.id)) == "recreate"
    assert list(api.pods) == [f"elastic-gpu-{big.id}-g2"]
    assert ("delete pod", first) in api.calls
    assert backend.sync(broker.job(big.id)) == "keep"  # idempotent
    (agent,) = [c for c in api.pods[f"elastic-gpu-{big.id}-g2"].spec.init_containers if c.name == "elastic-agent"]
    assert agent.args[agent.args.index("--pod-generation") + 1] == "2"  # never a newer one in place


def test_the_backend_lists_a_job_s_pods_once_per_start_or_sync_and_again_only_after_a_deletion(cluster):
    """Every listing is a request to the API server, made for every job on every sync: a start
    (Secret, then the pod) lists once, a sync that keeps or creates the pod once, and a re-creation
    lists again after its deletion (the old pod may still be terminating)."""
    broker, api = cluster
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    big = submit(broker, "big", 1, 4)
    backend.start(big)
    assert api.listed == 1 and len(api.pods) == 1
    broker.ack(big.id, 1)
    api.listed = 0
    assert backend.sync(broker.job(big.id)) == "keep" and api.listed == 1
    submit(broker, "x", 4, 4)
    submit(broker, "y", 2, 2)  # big shrinks: generation 2, a new pod
    api.listed = 0
    assert backend.sync(broker.job(big.id)) == "recreate" and api.listed == 2
    api.listed = 0
    backend.start(broker.job(big.id))  # a retried start while the pod is pending: nothing to do
    assert api.listed == 1 and list(api.pods) == [f"elastic-gpu-{big.id}-g2"]


def test_a_new_generation_s_pod_starts_only_once_the_old_pod_is_gone(cluster):
    """A deleted pod's trainer runs on through its grace period (it checkpoints), and the broker
    frees its GPUs once the new pod's agent acks: so the new pod is created only once the old one
    has terminated, in recreate mode and when an in-place job moves to another node."""
    broker, api = cluster
    api.graceful = True
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    big = submit(broker, "big", 1, 4)
    backend.start(big)
    broker.ack(big.id, 1)
    (first,) = api.pods
    submit(broker, "x", 4, 4)
    submit(broker, "y", 2, 2)  # big shrinks on its node: generation 2, a new pod
    assert backend.sync(broker.job(big.id)) == "wait"  # the old pod is terminating
    assert backend.sync(broker.job(big.id)) == "wait" and list(api.pods) == [first]
    assert api.pods[first].metadata.deletion_timestamp
    api.terminated()
    assert backend.sync(broker.job(big.id)) == "create"
    assert list(api.pods) == [f"elastic-gpu-{big.id}-g2"]
    (agent,) = [c for c in api.pods[f"elastic-gpu-{big.id}-g2"].spec.init_containers if c.name == "elastic-agent"]
    node = pod_node(api.pods[f"elastic-gpu-{big.id}-g2"])
    assert agent.args[agent.args.index("--host-node") + 1] == node  # a generation elsewhere is not run here


def test_waiting_job_gets_no_pod_until_placed(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    hogs = [submit(broker, f"hog{i}", 4, 4) for i in range(2)]
    waiting = submit(broker, "waiting", 2, 2)
    backend.start(waiting)
    assert api.pods == {} and broker.job(waiting.id).status is JobStatus.QUEUED
    assert backend.problem(broker.job(waiting.id)) is None  # no pod yet, and none expected
    broker.finish(hogs[0].id)
    assert backend.sync(broker.job(waiting.id)) == "create"


def a_running_pod(cluster, gpus: int = 1):
    """A job of ``gpus`` GPUs started, its first generation acked: the broker, the API, the
    backend, the job and its pod's name."""
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit(broker, "j", gpus, gpus)
    backend.start(job)
    broker.ack(job.id, 1)
    (name,) = api.pods
    return broker, api, backend, job, name


def test_evicted_oom_and_deleted_pods_are_reported_with_their_reason(cluster):
    broker, api, backend, job, name = a_running_pod(cluster)
    api.set_phase(name, "Failed", reason="Evicted", message="The node was low on resource: memory.")
    evicted = backend.problem(broker.job(job.id))
    assert "Evicted" in evicted.reason and "low on resource" in evicted.reason and not evicted.gone
    api.oom(name)
    assert "OOMKilled (exit code 137)" in backend.problem(broker.job(job.id)).reason
    assert backend.log_tail(job.id)[-1] == "CUDA error: out of memory"
    api.delete_namespaced_pod(name, "ml")  # someone ran kubectl delete
    assert "deleted from outside" in backend.problem(broker.job(job.id)).reason
    assert not backend.is_running(job.id)


def test_api_errors_409_404_500(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit(broker, "j", 1, 1)
    backend.start(job)
    secret = f"elastic-gpu-token-{job.id}"
    token = api.secrets[secret].string_data["token"]
    backend.start(job)  # a retried task while the pod runs: reattached, the agent's token kept
    assert len(api.pods) == 1 and api.secrets[secret].string_data["token"] == token
    api.delete_namespaced_pod(next(iter(api.pods)), "ml")
    backend.start(job)  # no pod: 409 on the Secret, replaced with a fresh token; the pod re-created
    assert len(api.pods) == 1 and api.secrets[secret].string_data["token"] != token
    assert broker.verify_token(job.id, api.secrets[secret].string_data["token"])
    backend.stop(job.id)
    backend.stop(job.id)  # 404s: already gone, fine
    other = submit(broker, "k", 1, 1)
    api.fail["create_namespaced_pod"] = 500  # e.g. an admission webhook that is down: named at once
    with pytest.raises(BackendError, match="cannot create pod .*500"):
        backend.start(other)
    api.fail["delete_namespaced_secret"] = 500
    with pytest.raises(BackendError, match="cannot delete the job's token Secret: 500"):
        backend.stop(other.id)


def _mounted_token(api, job_id):
    """What the kubelet writes into the agent's token file: the Secret's current token."""
    return api.secrets[f"elastic-gpu-token-{job_id}"].string_data["token"]


def test_a_retried_start_while_the_pod_runs_keeps_the_running_agents_token_valid(cluster):
    broker, api = cluster
    job = submit(broker, "j", 1, 1)
    KubernetesBackend(config(), broker, api).start(job, context=CONTEXT)
    broker.start(job.id, "kubernetes:ml/elastic-gpu-" + job.id)
    (pod_name,) = api.pods
    mounted = _mounted_token(api, job.id)
    for phase in ("Pending", "Running"):
        api.set_phase(pod_name, phase)
        retry = KubernetesBackend(config(), broker, api)  # the retried task: another worker, another backend
        retry.start(broker.job(job.id), context=CONTEXT)
        assert broker.verify_token(job.id, mounted), f"the agent of a {phase} pod was locked out"
        assert _mounted_token(api, job.id) == mounted
    assert list(api.pods) == [pod_name]


@pytest.fixture
def token_checking_api(cluster):
    """An HTTP server standing in for the broker API's authentication: 200 when the bearer token is
    the job's current one (``GpuBroker.verify_token``), 403 otherwise."""
    broker, _ = cluster

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's name for it
            job_id = self.path.split("/")[4]
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            ok = broker.verify_token(job_id, token)
            self.send_response(200 if ok else 403)
            self.send_header("x-elastic-gpu-broker", "1")  # as the broker's every answer
            self.send_header("x-elastic-gpu-job-answer", "1")  # as its answers about the job's token
            self.end_headers()
            self.wfile.write(b"null" if ok else json.dumps({"detail": "bad token"}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_rotated_token_reaches_the_running_agent_through_its_mounted_file(cluster, token_checking_api,
                                                                              tmp_path):
    """A pod whose phase is Unknown (its node lost contact) does not count as running, so a retried
    start rotates the token; its agent, if still alive, re-reads the mounted file on each request
    and follows the rotation as soon as the kubelet refreshes the file, without a restart."""
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit(broker, "j", 1, 1)
    backend.start(job)
    token_file = tmp_path / "token"
    token_file.write_text(_mounted_token(api, job.id) + "\n")
    agent = HttpBrokerTransport(token_checking_api, token_file=token_file)
    agent.progress(job.id, 1.0)
    api.set_phase(next(iter(api.pods)), "Unknown")
    backend.start(broker.job(job.id))  # not running: a fresh token in the Secret, the pod kept
    assert len(api.pods) == 1 and not broker.verify_token(job.id, token_file.read_text().strip())
    with pytest.raises(BrokerRejected, match="403"):
        agent.progress(job.id, 2.0)  # until the kubelet refreshes the file (the agent retries)
    token_file.write_text(_mounted_token(api, job.id))
    agent.progress(job.id, 3.0)  # the same agent, the new token


def test_the_agent_reads_a_missing_or_empty_token_file_as_a_transient_failure(tmp_path):
    from airflow_elastic_gpu.sidecar.http_transport import BrokerUnavailable

    agent = HttpBrokerTransport("http://127.0.0.1:9", token_file=tmp_path / "token")
    with pytest.raises(BrokerUnavailable, match="cannot read the job's token file"):
        agent.progress("j", 1.0)
    (tmp_path / "token").write_text("\n")
    with pytest.raises(BrokerUnavailable, match="is empty"):
        agent.progress("j", 1.0)


def test_a_job_whose_pod_cannot_be_created_is_failed_at_once_and_cleaned_up(cluster, monkeypatch):
    from airflow.exceptions import AirflowException

    from airflow_elastic_gpu.backends import kubernetes as kmod
    from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

    broker, api = cluster
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", broker.url)
    monkeypatch.setattr(kmod.KubernetesBackend, "core_v1", property(lambda self: api))
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, backend="kubernetes",
                                 image="train:1", kubernetes={"namespace": "ml"})
    api.fail["create_namespaced_pod"] = 403  # e.g. a namespace policy refuses the pod
    with pytest.raises(AirflowException, match="cannot create pod .*403"):
        op.execute({"ti": _TI()})
    (job,) = broker.jobs()
    assert job.status is JobStatus.FAILED and "could not start the job: cannot create pod" in job.reason
    assert job.in_use_gpus == () and job.target_gpus == ()
    assert api.pods == {} and api.secrets == {}  # the token Secret it had created is deleted


def test_bad_env_is_refused_before_anything_is_created(cluster):
    broker, api = cluster
    job = submit(broker, "j", 1, 1)
    with pytest.raises(BackendError, match=r"env\['A'\] must be a string"):
        KubernetesBackend(config(), broker, api).start(job, env={"A": 1})
    assert api.secrets == {} and api.pods == {}


class _TI:
    dag_id, task_id, run_id, map_index = "dag", "train", "manual__1", -1

    def __init__(self):
        self.xcom = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_on_finish_action_keep_and_delete_succeeded(cluster):
    broker, api = cluster
    for action, succeeded, left in (("keep_pod", True, 1), ("delete_succeeded_pod", False, 1),
                                    ("delete_succeeded_pod", True, 0)):
        api.pods.clear()
        backend = KubernetesBackend(config(on_finish_action=action), broker, api)
        job = submit(broker, f"j-{action}-{succeeded}", 1, 1)
        backend.start(job)
        broker.cancel(job.id)
        backend.stop(job.id, succeeded=succeeded)
        assert len(api.pods) == left, action
        assert f"elastic-gpu-token-{job.id}" not in api.secrets


def test_nodes_are_registered_from_gpu_feature_discovery_labels(tmp_path):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    api = FakeCoreV1()
    api.nodes = [
        k8s.V1Node(metadata=k8s.V1ObjectMeta(name="a100-0", labels={
            "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})),
        k8s.V1Node(metadata=k8s.V1ObjectMeta(name="t4-0", labels={}),
                   status=k8s.V1NodeStatus(capacity={"nvidia.com/gpu": "4"})),
        k8s.V1Node(metadata=k8s.V1ObjectMeta(name="cpu-0", labels={}), status=k8s.V1NodeStatus(capacity={})),
    ]
    assert register_nodes_from_cluster(broker, api, pool="gpus") == ["a100-0", "t4-0"]
    nodes = {n.name: n for n in broker.nodes("gpus")}
    assert len(nodes["a100-0"].gpus) == 8 and nodes["a100-0"].gpus[0].gpu_type == "NVIDIA-A100-SXM4-80GB"
    assert len(nodes["t4-0"].gpus) == 4


def test_operator_and_trigger_run_a_kubernetes_job_against_the_fake_api(cluster, monkeypatch):
    """The operator builds the config at parse time, starts the job (Secret, pod), and the trigger
    keeps the pod in step with the broker, reports a broken pod, and cleans up."""
    import asyncio

    from airflow.exceptions import AirflowException
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_elastic_gpu.backends import kubernetes as kmod
    from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
    from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

    broker, api = cluster
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", str(broker.engine.url))
    monkeypatch.setattr(kmod.KubernetesBackend, "core_v1", property(lambda self: api))
    with pytest.raises(AirflowException, match="needs an image"):
        ElasticTrainingOperator(task_id="t", command="python train.py", total_steps=10, backend="kubernetes")
    with pytest.raises(AirflowException, match="resize_mechanism must be one of"):
        ElasticTrainingOperator(task_id="t", command="x", total_steps=10, backend="kubernetes", image="i",
                                kubernetes={"resize_mechanism": "teleport"})
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=1000, min_gpus=1,
                                 max_gpus=4, backend="kubernetes", image="registry.example/train:1",
                                 kubernetes={"namespace": "ml", "broker_api_url": "http://broker:8793"})

    class TI:
        dag_id, task_id, run_id, map_index = "dag", "train", "manual__1", -1
        xcom: dict = {}

        def xcom_push(self, key, value):
            self.xcom[key] = value

    ti = TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})
    job_id = ti.xcom["job_id"]
    (pod_name,) = api.pods
    assert api.pods[pod_name].metadata.annotations["elastic-gpu.airflow.apache.org/dag_id"] == "dag"
    trigger = deferred.value.trigger
    assert isinstance(trigger, ElasticTrainingTrigger) and trigger.kubernetes["namespace"] == "ml"
    classpath, kwargs = trigger.serialize()
    resumed = ElasticTrainingTrigger(**kwargs)
    broker.ack(job_id, 1)
    api.set_phase(pod_name, "Failed", reason="Evicted", message="node drained")

    async def first_event():
        return await asyncio.wait_for(resumed.run().__anext__(), 30)

    resumed.poll_interval = 0.05
    event = asyncio.run(first_event())
    assert event.payload["status"] == "failed" and "Evicted" in event.payload["reason"]
    assert "CUDA error" in event.payload["reason"]  # the trainer's last log lines
    assert api.pods == {} and not api.secrets  # cleaned up (on_finish_action=delete_pod)
    too_big = ElasticTrainingOperator(task_id="big", command="x", total_steps=10, min_gpus=1, max_gpus=8,
                                      backend="kubernetes", image="i")
    with pytest.raises(AirflowException, match=r"big: max_gpus=8 is larger than any node"):
        too_big.execute({"ti": TI()})  # a gang (one pod per node) needs the placeholders in its command
