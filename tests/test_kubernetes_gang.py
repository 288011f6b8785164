"""Jobs on several nodes on Kubernetes (one pod per node and a headless Service): manifests
validated strictly against the official schema, their semantics, the gang's life against a fake of
the CoreV1 API (each pod's agent running its node's part: ``test_kubernetes_gang_agent.py``)."""

from __future__ import annotations

import copy

import pytest
from conftest import RESIZE_AT_ONCE
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException
from test_kubernetes import CONTEXT, FakeCoreV1, config, validate

from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, PodBuilder, to_dict
from airflow_elastic_gpu.backends.kubernetes_config import model
from airflow_elastic_gpu.backends.kubernetes_gang import LABEL_NODE, GangBuilder, service_name
from airflow_elastic_gpu.backends.kubernetes_pods import pod_node
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec

GANG = "torchrun --nnodes={nnodes} --node_rank={node_rank} --nproc_per_node={num_gpus} " \
       "--rdzv_backend=c10d --rdzv_endpoint={master_addr}:{master_port} train.py"
NODES = ("gpu-node-0", "gpu-node-1", "ip-10-0-3-7.ec2.internal")


class FakeCoreV1WithServices(FakeCoreV1):
    """:class:`FakeCoreV1` with the Service calls a gang needs."""

    def __init__(self) -> None:
        super().__init__()
        self.services: dict[str, k8s.V1Service] = {}

    def create_namespaced_service(self, namespace, body):
        self._maybe_fail("create_namespaced_service")
        if body.metadata.name in self.services:
            raise ApiException(status=409, reason="AlreadyExists")
        self.services[body.metadata.name] = copy.deepcopy(body)
        self.calls.append(("create service", body.metadata.name))

    def delete_namespaced_service(self, name, namespace):
        if self.services.pop(name, None) is None:
            raise ApiException(status=404, reason="NotFound")
        self.calls.append(("delete service", name))


def agent_args(pod: dict) -> list[str]:
    (agent,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "elastic-agent"]
    return agent["args"]


def arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("mechanism", ["inplace", "recreate"])
@pytest.mark.parametrize("size", [2, 3])
def test_gang_manifests_validate_strictly_against_the_kubernetes_schema(size, mechanism):
    builder = GangBuilder(PodBuilder(config(resize_mechanism=mechanism)))
    service = to_dict(builder.service("3f1c-job", CONTEXT))
    validate(service)
    pods = [to_dict(builder.pod("3f1c-job", GANG, node, 4, progress_pattern=r"step (?P<step>\d+)",
                                checkpoint_dir="/ckpt/run1", env={"NCCL_DEBUG": "INFO"}, context=CONTEXT))
            for node in NODES[:size]]
    for pod in pods:
        validate(pod)
    # what the schema cannot check: one pod per node, each with its own DNS name under the Service
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29500, "targetPort": 29500,
                                         "protocol": "TCP"}]
    assert [pod_node(k8s.V1Pod(spec=model("V1PodSpec", p["spec"]))) for p in pods] == list(NODES[:size])
    hostnames = [p["spec"]["hostname"] for p in pods]
    assert len(set(hostnames)) == size and all(len(h) <= 63 for h in hostnames)
    assert len({p["metadata"]["name"] for p in pods}) == size
    for pod, node in zip(pods, NODES, strict=False):
        assert pod["spec"]["subdomain"] == service["metadata"]["name"] == service_name("3f1c-job")
        assert all(pod["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
        args = agent_args(pod)
        assert arg(args, "--node") == node and arg(args, "--rendezvous-port") == "29500"
        assert arg(args, "--gang-domain") == f"{service_name('3f1c-job')}.ml.svc"
        assert ("--pod-generation" in args) == (mechanism == "recreate")
        assert pod["metadata"]["labels"][LABEL_NODE]


@pytest.fixture
def cluster(tmp_path):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    for node in NODES:
        broker.register_node(node, 4, gpu_type="NVIDIA A100")
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    yield broker, FakeCoreV1WithServices()
    broker.engine.dispose()


def submit_gang(broker, lo=8, hi=12):
    return broker.submit(JobSpec("gang", GANG, lo, hi, total_steps=1000, backend="kubernetes"))


def nodes_of(gpus) -> list[str]:
    return sorted({g.node for g in gpus})


def pods_by_node(api) -> dict[str, str]:
    return {pod_node(p): name for name, p in api.pods.items()}


def ack_all(broker, job_id, generation, nodes):
    for node in nodes:
        broker.ack(job_id, generation, node=node)


def test_a_gang_is_created_resized_in_place_and_cleaned_up_together(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job, context=CONTEXT)
    assert backend.is_gang(broker.job(job.id))
    assert list(api.services) == [service_name(job.id)]
    assert sorted(pods_by_node(api)) == list(NODES)  # one pod per node of the 12-GPU target
    ack_all(broker, job.id, 1, NODES)
    assert broker.job(job.id).acked_generation == 1
    first_pods = dict(api.pods)
    other = broker.submit(JobSpec("other", "python train.py", 4, 4, total_steps=100, backend="kubernetes"))
    target = broker.target(job.id)
    kept = nodes_of(target.gpus)
    (dropped,) = set(NODES) - set(kept)
    assert target.generation == 2 and len(kept) == 2  # the gang shrinks to two nodes for the other job
    assert backend.sync(broker.job(job.id)) == "keep"  # in place: every pod stays while they resize
    assert api.pods == first_pods
    ack_all(broker, job.id, 2, kept)
    assert broker.job(other.id).target_gpus == ()  # the dropped node's trainer has not stopped yet
    broker.ack(job.id, 2, node=dropped)  # its agent suspended the trainer and acked
    assert nodes_of(broker.job(other.id).target_gpus) == [dropped]
    assert backend.sync(broker.job(job.id)) == "shrink"  # the generation runs without it: pod deleted
    assert sorted(pods_by_node(api)) == kept
    assert backend.problem(broker.job(job.id)) is None
    broker.cancel(other.id)
    assert broker.target(job.id).generation == 2  # its GPUs are held until its pod's agent reports the stop
    broker.fail(other.id, "the trainer stopped")  # that report (the pod's agent, over the API)
    grown = broker.target(job.id)
    assert grown.generation == 3 and nodes_of(grown.gpus) == list(NODES)
    assert backend.sync(broker.job(job.id)) == "create"  # the node it grows to gets a pod
    assert sorted(pods_by_node(api)) == list(NODES)
    ack_all(broker, job.id, 3, NODES)
    broker.finish(job.id, 0, {"accuracy": 0.9})
    backend.stop(job.id, succeeded=True)
    assert api.pods == {} and api.services == {} and api.secrets == {}


def test_a_gang_s_start_lists_its_pods_once(cluster):
    """Each pod listing is a request to the API server: a gang's start lists the job's pods once
    (to see whether one runs, whether it is a gang, and what to create), as a single pod's does."""
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job, context=CONTEXT)
    assert api.listed == 1 and sorted(pods_by_node(api)) == list(NODES)
    api.listed = 0
    backend.sync(broker.job(job.id), context=CONTEXT)
    assert api.listed == 1


def test_a_gang_in_recreate_mode_replaces_every_pod_together(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(resize_mechanism="recreate"), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    broker.submit(JobSpec("other", "python train.py", 4, 4, total_steps=100, backend="kubernetes"))
    kept = nodes_of(broker.target(job.id).gpus)
    (dropped,) = set(NODES) - set(kept)
    assert backend.sync(broker.job(job.id)) == "recreate"
    assert all(name.endswith("-g2") for name in api.pods) and sorted(pods_by_node(api)) == kept
    assert sum(1 for call, _ in api.calls if call == "delete pod") == 3  # the old generation's three
    # the dropped node's pod is gone from the API: nothing runs there, the backend acks it
    assert broker.job(job.id).acked_generation == 1
    ack_all(broker, job.id, 2, kept)
    assert broker.job(job.id).acked_generation == 2
    assert backend.sync(broker.job(job.id)) == "keep"  # idempotent
    args = api.pods[pods_by_node(api)[kept[0]]].spec.init_containers[1].args
    assert arg(args, "--pod-generation") == "2" and arg(args, "--node") == kept[0]
    assert dropped not in pods_by_node(api)


def an_acked_gang(cluster, mechanism: str = "inplace"):
    """A gang started, its first generation acked on every node, on an API server where a deleted
    pod terminates through its grace period: the broker, the API, the backend and the job."""
    broker, api = cluster
    api.graceful = True
    backend = KubernetesBackend(config(resize_mechanism=mechanism), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    return broker, api, backend, job


def test_a_gang_s_new_pod_on_a_node_waits_for_the_old_one_there_to_be_gone(cluster):
    """Recreate mode, on an API server where a deleted pod terminates through its grace period:
    the new generation's pod on a node starts only once the old one there is gone (the new pod's
    ack frees GPUs the old trainer may still use), and the dropped node is acked only then too."""
    broker, api, backend, job = an_acked_gang(cluster, "recreate")
    broker.submit(JobSpec("other", "python train.py", 4, 4, total_steps=100, backend="kubernetes"))
    kept = nodes_of(broker.target(job.id).gpus)
    assert backend.sync(broker.job(job.id)) == "recreate+wait+wait"
    assert all(p.metadata.deletion_timestamp for p in api.pods.values())  # only terminating pods
    assert not [n for n in api.pods if n.endswith("-g2")]
    assert broker.job(job.id).acked_generation == 1  # nothing acked for the terminating pods' nodes
    api.terminated()
    assert backend.sync(broker.job(job.id)) == "create"
    assert all(name.endswith("-g2") for name in api.pods) and sorted(pods_by_node(api)) == kept
    ack_all(broker, job.id, 2, kept)  # the dropped node, its pod gone, was acked by the backend
    assert broker.job(job.id).acked_generation == 2


def test_one_evicted_pod_fails_the_job_and_the_whole_gang_is_deleted(cluster):
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    victim = pods_by_node(api)[NODES[1]]
    api.set_phase(victim, "Failed", reason="Evicted", message="The node was low on resource: memory.")
    problem = backend.problem(broker.job(job.id))
    assert "Evicted" in problem.reason and NODES[1] in problem.reason and not problem.gone
    JobWatcher(broker, backend, job.id).poll()  # what the trigger does each poll
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and "Evicted" in failed.reason
    # the evicted node's GPUs are free; the other nodes' stay held until their trainers have
    # stopped (their agents report it, or the lease passes): they ran until their pods were deleted
    assert {g.node for g in failed.in_use_gpus} == {NODES[0], NODES[2]}
    assert api.pods == {} and api.services == {} and api.secrets == {}  # every node's pod, not half
    for node in (NODES[0], NODES[2]):  # what each pod's agent reports once its trainer has stopped
        broker.fail(job.id, "the trainer stopped (job is failed in the broker)", node=node)
    assert broker.job(job.id).in_use_gpus == ()


def test_a_pod_of_a_running_gang_deleted_from_outside_fails_the_job(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    api.delete_namespaced_pod(pods_by_node(api)[NODES[0]], "ml")
    assert backend.sync(broker.job(job.id)) == "keep"  # not re-created behind the other nodes' backs
    assert f"the pod of node {NODES[0]} was deleted" in backend.problem(broker.job(job.id)).reason


def test_a_pod_of_a_running_gang_left_terminating_on_a_lost_node_fails_the_job(cluster):
    """A node lost (unreachable): its pod is deleted by the node lifecycle controller but stays
    listed, terminating, until the node object goes. The other nodes' agents keep the job's lease,
    so nothing else ends the gang: it hung, every GPU held, its trainers waiting for the lost one."""
    broker, api, backend, job = an_acked_gang(cluster)
    assert backend.problem(broker.job(job.id)) is None
    api.delete_namespaced_pod(pods_by_node(api)[NODES[1]], "ml")  # never terminated: its kubelet is gone
    problem = backend.problem(broker.job(job.id))
    assert f"the pod of node {NODES[1]} was deleted" in problem.reason and problem.running


def test_a_recreate_resize_published_during_a_poll_does_not_fail_the_gang(cluster):
    """The poll's own rebalance publishes a new generation and its sync deletes the gang's pods to
    re-create them: the job the poll read still reads acked, and its terminating pods were taken
    for pods deleted from outside."""
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, _api, backend, job = an_acked_gang(cluster, "recreate")
    real = broker.maybe_rebalance

    def rebalance_with_a_new_job(pool):  # the poll's periodic rebalance: another job came meanwhile
        broker.submit(JobSpec("other", "python train.py", 4, 4, total_steps=100, backend="kubernetes"))
        return real(pool)

    broker.maybe_rebalance = rebalance_with_a_new_job
    JobWatcher(broker, backend, job.id).poll()
    assert broker.job(job.id).target_generation == 2 and broker.job(job.id).status is JobStatus.RUNNING


def test_pods_of_two_nodes_deleted_from_outside_fail_the_job_with_every_gpu_held(cluster, clock):
    """Two pods of a three-node gang deleted by someone else: the job fails naming both nodes. Their
    GPUs were freed at once, taken for stopped; a pod force-deleted (grace 0, or by the pod garbage
    collector after its node went away) leaves the API while its containers may run on. Every GPU
    stays held until each node's agent reports its trainer stopped, or the lease passes."""
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    _, api = cluster
    broker = GpuBroker(cluster[0].url, clock=clock)
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    for node in (NODES[0], NODES[2]):
        api.delete_namespaced_pod(pods_by_node(api)[node], "ml")
    problem = backend.problem(broker.job(job.id))
    assert (problem.node, problem.running) == (NODES[0], True)
    assert f"the pods of nodes {NODES[0]}, {NODES[2]} were deleted" in problem.reason
    JobWatcher(broker, backend, job.id).poll()
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and NODES[2] in failed.reason
    held = {n.name for n in broker.nodes() for g in n.gpus if g.in_use_by == job.id}
    assert held == set(NODES)
    broker.fail(job.id, "the trainer stopped", node=NODES[1])  # the pod left: its agent reports
    clock.advance(broker.pool_config().lease_s + 1)
    broker.rebalance()  # the deleted pods' agents never report: the lease frees their GPUs
    assert not any(g.in_use_by == job.id for n in broker.nodes() for g in n.gpus)


def test_an_evicted_pod_and_a_deleted_one_fail_the_job(cluster):
    """One pod evicted (still listed: its trainer no longer runs) and another deleted (its containers
    may run on after a force deletion): the evicted node's GPUs are free when the job fails, the
    others' wait for their agents or the lease."""
    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    api.set_phase(pods_by_node(api)[NODES[1]], "Failed", reason="Evicted", message="The node was low on memory.")
    api.delete_namespaced_pod(pods_by_node(api)[NODES[2]], "ml")
    problem = backend.problem(broker.job(job.id))
    assert problem.node == NODES[1] and not problem.running
    JobWatcher(broker, backend, job.id).poll()
    assert {g.node for g in broker.job(job.id).in_use_gpus} == {NODES[0], NODES[2]}


@pytest.mark.parametrize("mechanism", ["inplace", "recreate"])
def test_a_preemptible_gang_of_pods_is_suspended_and_resumed(cluster, mechanism):
    """A gang of pods on all three nodes opted in to suspension; a short job arrives: the gang's
    generation with no GPUs leaves its pods in place (each agent stops its trainer, which
    checkpoints, and acks its node); once every node acked, the short job runs; when it ends the
    gang resumes on the three nodes: in place its pods go on, with re-creation they are replaced
    by the new generation's."""
    broker, api = cluster
    broker.configure_pool(policy_params={**RESIZE_AT_ONCE, "suspend": True, "min_runtime_s": 0.0})
    backend = KubernetesBackend(config(resize_mechanism=mechanism), broker, api)
    job = broker.submit(JobSpec("gang", GANG, 12, 12, total_steps=100_000, backend="kubernetes", preemptible=True))
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    first_pods = set(api.pods)
    short = broker.submit(JobSpec("short", "python train.py", 4, 4, total_steps=10, backend="kubernetes"))
    gang = broker.job(job.id)
    assert gang.status is JobStatus.SUSPENDED and gang.target_gpus == () and gang.target_generation == 2
    assert backend.sync(gang) == "wait" and set(api.pods) == first_pods  # the agents stop the trainers
    assert backend.problem(gang) is None
    ack_all(broker, job.id, 2, NODES)
    assert broker.job(job.id).in_use_gpus == () and len(broker.job(short.id).target_gpus) == 4
    broker.ack(short.id, 1)
    broker.finish(short.id)
    gang = broker.job(job.id)
    assert gang.status is JobStatus.RUNNING and len(gang.target_gpus) == 12 and gang.target_generation == 3
    backend.sync(gang)
    if mechanism == "inplace":
        assert set(api.pods) == first_pods  # each agent restarts its trainer from the checkpoint
    else:
        assert not set(api.pods) & first_pods and len(api.pods) == 3  # the new generation's pods
    ack_all(broker, job.id, 3, NODES)
    assert broker.job(job.id).acked_generation == 3 and len(broker.job(job.id).in_use_gpus) == 12
    kinds = [e.kind for e in broker.events(job_id=job.id)]
    assert "suspend" in kinds and "resume" in kinds[kinds.index("suspend"):], kinds


def test_a_gang_suspended_after_one_nodes_pod_was_deleted_frees_its_gpus(cluster):
    """One node's pod of a preemptible gang is gone (deleted, its node drained) when a short job
    suspends the gang: no agent is left there to ack the generation without GPUs, so the backend
    acks that node for it once the other nodes' agents have. It waited for that ack for ever, the
    gang holding all twelve GPUs and the short job never placed."""
    broker, api = cluster
    broker.configure_pool(policy_params={**RESIZE_AT_ONCE, "suspend": True, "min_runtime_s": 0.0})
    backend = KubernetesBackend(config(), broker, api)
    job = broker.submit(JobSpec("gang", GANG, 12, 12, total_steps=100_000, backend="kubernetes", preemptible=True))
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    api.delete_namespaced_pod(pods_by_node(api)[NODES[2]], "ml")
    short = broker.submit(JobSpec("short", "python train.py", 4, 4, total_steps=10, backend="kubernetes"))
    gang = broker.job(job.id)
    assert gang.status is JobStatus.SUSPENDED and gang.target_gpus == ()
    ack_all(broker, job.id, 2, NODES[:2])  # the agents of the pods left stop their trainers
    assert backend.sync(broker.job(job.id)) == "wait"
    suspended = broker.job(job.id)
    assert suspended.acked_generation == 2 and suspended.in_use_gpus == ()
    assert len(broker.job(short.id).target_gpus) == 4


def test_a_job_that_fits_on_one_node_keeps_its_single_pod(cluster):
    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = broker.submit(JobSpec("small", "python train.py", 1, 4, total_steps=10, backend="kubernetes"))
    backend.start(job)
    assert not backend.is_gang(broker.job(job.id)) and api.services == {}
    (pod,) = api.pods.values()
    assert pod.spec.subdomain is None and LABEL_NODE not in pod.metadata.labels


# --------------------------------------------------------------------------- one agent per pod


def test_a_gang_pod_whose_agent_cannot_start_while_its_trainer_runs_keeps_that_nodes_gpus(cluster):
    """As for one pod (``test_kubernetes_failures.py``): the broken node's GPUs stay held with the
    others' until its trainer has stopped; they were freed at once."""
    from test_kubernetes_failures import _agent_cannot_start_while_the_trainer_runs

    from airflow_elastic_gpu.triggers.watcher import JobWatcher

    broker, api = cluster
    backend = KubernetesBackend(config(), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    _agent_cannot_start_while_the_trainer_runs(api, pods_by_node(api)[NODES[1]])
    problem = backend.problem(broker.job(job.id))
    assert problem.node == NODES[1] and problem.running
    JobWatcher(broker, backend, job.id).poll()
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED
    assert {g.node for g in failed.in_use_gpus} == set(NODES)  # the broken node's too: its trainer ran


def test_a_gang_pod_pending_past_the_startup_grace_fails_the_job(cluster):
    """One node's pod of a gang stays Pending (a volume that will not mount there): the other pods'
    agents keep the job's lease, so only the backend can tell; it did not, and the gang waited for
    its rendezvous for ever."""
    from datetime import UTC, datetime, timedelta

    broker, api = cluster
    backend = KubernetesBackend(config(startup_grace_s=60), broker, api)
    job = submit_gang(broker)
    backend.start(job)
    ack_all(broker, job.id, 1, NODES)
    for pod in api.pods.values():
        pod.status = k8s.V1PodStatus(phase="Running")
    stuck = api.pods[pods_by_node(api)[NODES[2]]]
    stuck.status = k8s.V1PodStatus(phase="Pending")
    stuck.metadata.creation_timestamp = datetime.now(UTC) - timedelta(seconds=30)
    assert backend.problem(broker.job(job.id)) is None  # within the grace
    stuck.metadata.creation_timestamp = datetime.now(UTC) - timedelta(hours=3)
    problem = backend.problem(broker.job(job.id))
    assert problem.node == NODES[2] and "Pending for 10800s (startup_grace_s 60s)" in problem.reason


def test_a_job_of_the_gangs_shape_on_one_node_runs_as_a_gang_the_broker_may_spread(tmp_path):
    """A command with the gang's placeholders whose max_gpus fits one node ran as a single pod, while
    the broker may spread such a job over nodes at any rebalance (here its node drained): every sync
    then raised "spans nodes ... but is not larger than a node", for every later backend too, and the
    pod's agent never applied the generation (its trainer on the drained node, its new GPUs idle)."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("big", 8, gpu_type="A100")
    for node in ("small-0", "small-1"):
        broker.register_node(node, 4, gpu_type="A100")
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    api = FakeCoreV1WithServices()
    job = broker.submit(JobSpec("j", GANG, 4, 8, total_steps=1000, backend="kubernetes"))
    KubernetesBackend(config(), broker, api).start(job)
    assert pods_by_node(api).keys() == {"big"} and api.services, "one pod, of a gang of one node"
    ack_all(broker, job.id, 1, ["big"])
    broker.set_node_schedulable("big", False)  # drained for maintenance
    broker.maybe_rebalance("default")
    spread = broker.job(job.id)
    assert nodes_of(spread.target_gpus) == ["small-0", "small-1"]
    done = KubernetesBackend(config(), broker, api).sync(spread)  # a renewed backend (a later poll)
    assert "create" in done and {"small-0", "small-1"} <= pods_by_node(api).keys(), done
    ack_all(broker, job.id, spread.target_generation, ["big", "small-0", "small-1"])
    KubernetesBackend(config(), broker, api).sync(broker.job(job.id))
    assert pods_by_node(api).keys() == {"small-0", "small-1"}, "the drained node's pod is deleted"
    broker.engine.dispose()


class AtServiceQuota(FakeCoreV1WithServices):
    """A namespace at its ``services`` ResourceQuota: a create is refused with 403 once a Service
    exists, that very Service too (quota admission runs before the existence check)."""

    def create_namespaced_service(self, namespace, body):
        if self.services:
            raise ApiException(status=403, reason="Forbidden")
        super().create_namespaced_service(namespace, body)


def test_a_new_backend_syncs_a_gang_whose_namespace_is_at_its_service_quota(cluster):
    """Every backend made the Service again and took only 409 for "it exists": after a triggerer
    restart (or the trigger's new clients after a failed poll) each sync raised, the recreate
    resize never made its new pods, and the gang was LOST at its lease."""
    broker, _ = cluster
    api = AtServiceQuota()
    api.graceful = True
    KubernetesBackend(config(resize_mechanism="recreate"), broker, api).start(submit_gang(broker))
    (job,) = broker.jobs()
    ack_all(broker, job.id, 1, NODES)
    broker.submit(JobSpec("other", "python train.py", 4, 4, total_steps=100, backend="kubernetes"))
    assert broker.target(job.id).generation == 2  # the gang shrinks: a recreate resize
    done = KubernetesBackend(config(resize_mechanism="recreate"), broker, api).sync(broker.job(job.id))
    assert "recreate" in done, done  # the old pods deleted, terminating
    api.terminated()  # gone: the gang has no pod at all until the next sync makes the new ones
    KubernetesBackend(config(resize_mechanism="recreate"), broker, api).sync(broker.job(job.id))
    assert api.pods and len(api.services) == 1, "the new generation's pods were made"
