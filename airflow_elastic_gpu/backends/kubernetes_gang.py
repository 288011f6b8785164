"""Jobs on several nodes on Kubernetes: one pod per node (a *gang*) and a headless Service for the
rendezvous, created, resized and cleaned up together.

A job whose ``max_gpus`` exceeds every node of its pool runs as a gang (the rule ``submit``
applies). Each node's pod is the single-pod layout (:class:`~.kubernetes_builder.PodBuilder`) plus:

* ``hostname`` (:func:`~airflow_elastic_gpu.sidecar.gang.pod_hostname` of its node) and
  ``subdomain`` = the job's headless Service ``elastic-gpu-<job>`` (``clusterIP: None``, selecting
  the job's pods, ``publishNotReadyAddresses``), so that every pod's DNS name
  ``HOSTNAME.elastic-gpu-<job>.NAMESPACE.svc`` resolves as soon as it has an address;
* its agent runs with ``--node NODE --gang-domain elastic-gpu-<job>.NAMESPACE.svc
  --rendezvous-port PORT``: it writes its node's part of the generation
  (:func:`~airflow_elastic_gpu.sidecar.gang.gang_plan`: ``nnodes``, ``node_rank``, the DNS name
  of the rank-0 node's pod as ``master_addr``, the fixed ``rendezvous_port`` as ``master_port``)
  and acks *its node*; the broker moves the job's in-use set only once every node of the old and
  the new allocation has acked (``GpuBroker.ack(..., node=...)``).

Resizes (:meth:`GangPods.sync`):

* ``inplace``: pods stay; each pod's agent restarts its trainer with the new shape. A node the
  new generation adds gets a new pod; a node it drops keeps its pod, whose agent stops the trainer
  (suspended) and acks: the pod is deleted once the whole generation is acked.
* ``recreate``: every pod of an older generation is deleted and the new generation's pods are
  created together. A dropped node's pod cannot ack (it runs its own generation only): the
  backend acks that node for it once the pod is gone from the API (its trainer is then dead).

Failures: one pod evicted, failed or deleted from outside is a :class:`~.base.Problem` of the whole
job (the job watcher fails the job at once and the backend's ``stop`` deletes every pod and the
Service); one node's trainer exiting non-zero is reported by its agent, and every other agent then
sees the job ended and stops its trainer. Half a job never runs on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_elastic_gpu.backends.base import BackendError, Problem
from airflow_elastic_gpu.backends.kubernetes_config import (
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_PREFIX,
    label_value,
    resource_name,
)
from airflow_elastic_gpu.backends.kubernetes_pods import pod_node, pod_problem, pod_state
from airflow_elastic_gpu.broker.types import JobView
from airflow_elastic_gpu.sidecar.gang import pod_hostname

if TYPE_CHECKING:
    from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, PodBuilder

LABEL_NODE = f"{LABEL_PREFIX}node"
"""The node a gang's pod runs on (a label value; :func:`.kubernetes_pods.pod_node` reads the node itself)."""


def service_name(job_id: str) -> str:
    """The job's headless Service (and the pods' ``subdomain``): ``elastic-gpu-<job>``."""
    return resource_name("elastic-gpu", job_id)


def gang_domain(job_id: str, namespace: str) -> str:
    """The DNS domain of the job's pods: ``elastic-gpu-<job>.NAMESPACE.svc``."""
    return f"{service_name(job_id)}.{namespace}.svc"


def gang_pod_name(job_id: str, node: str, generation: int) -> str:
    """``elastic-gpu-<job>-<node's host name>-g<generation>`` (a DNS subdomain: at most 253 characters)."""
    return f"{service_name(job_id)}-{pod_hostname(node)}-g{generation}"


def generation_of(pod: Any) -> int:
    return int((pod.metadata.labels or {}).get(LABEL_GENERATION, 0))


def _live(pods: list[Any]) -> list[Any]:
    """The pods not being deleted (a deleted pod stays listed while it terminates)."""
    return [p for p in pods if p.metadata.deletion_timestamp is None]


class GangBuilder:
    """Builds a gang's Service and pods (pure: no API calls) on top of a :class:`PodBuilder`."""

    def __init__(self, builder: PodBuilder) -> None:
        self.builder = builder
        self.config = builder.config

    def service(self, job_id: str, context: Mapping[str, str] | None = None) -> k8s.V1Service:
        """The headless Service that gives each pod of the gang its DNS name."""
        context = {k: v for k, v in (context or {}).items() if k != "run_id"}
        port = self.config.rendezvous_port
        return k8s.V1Service(
            api_version="v1", kind="Service",
            metadata=k8s.V1ObjectMeta(name=service_name(job_id), namespace=self.config.namespace,
                                      labels=self.builder._labels(job_id, None, context)),
            spec=k8s.V1ServiceSpec(
                cluster_ip="None", selector={LABEL_JOB: label_value(job_id)},
                publish_not_ready_addresses=True,  # DNS before readiness: the rendezvous comes first
                ports=[k8s.V1ServicePort(name="rendezvous", port=port, target_port=port, protocol="TCP")]))

    def pod(self, job_id: str, command: str, node: str, generation: int, *,
            progress_pattern: str | None = None, checkpoint_dir: str | None = None,
            env: Mapping[str, str] | None = None, context: Mapping[str, str] | None = None) -> k8s.V1Pod:
        """The pod of ``job_id``'s gang on ``node``, created for ``generation``."""
        pod = self.builder.pod(job_id, command, node, generation, progress_pattern=progress_pattern,
                               checkpoint_dir=checkpoint_dir, env=env, context=context)
        c = self.config
        pod.metadata.name = gang_pod_name(job_id, node, generation)
        pod.metadata.labels[LABEL_NODE] = label_value(node)
        pod.spec.hostname = pod_hostname(node)
        pod.spec.subdomain = service_name(job_id)
        (agent,) = [x for x in pod.spec.init_containers if x.name == "elastic-agent"]
        agent.args = [*agent.args, "--node", node, "--gang-domain", gang_domain(job_id, c.namespace),
                      "--rendezvous-port", str(c.rendezvous_port)]
        (trainer,) = [x for x in pod.spec.containers if x.name == "trainer"]
        trainer.ports = [k8s.V1ContainerPort(name="rendezvous", container_port=c.rendezvous_port, protocol="TCP")]
        return pod


class GangPods:
    """The gang half of :class:`~.kubernetes.KubernetesBackend`: its pods, Service and acks."""

    def __init__(self, backend: KubernetesBackend) -> None:
        self.backend = backend
        self.builder = GangBuilder(backend.builder)
        self._services: set[str] = set()  # jobs whose Service this backend made or found (not sent again)

    @property
    def namespace(self) -> str:
        return self.backend.config.namespace

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None, pods: list[Any] | None = None) -> str:
        """Make the gang's pods match the broker's target; returns what it did: ``wait`` (no GPUs
        published, or suspended: the pods stay, and a node whose pod is gone is acked for it),
        ``keep``, ``create`` (pods added: the first generation, or a growth to more nodes),
        ``recreate`` (the pods of an older generation replaced), ``shrink`` (pods of nodes the acked
        generation no longer uses deleted), ``wait`` as well when a node's new pod waits for the
        job's terminating pod there to be gone, joined with ``+`` when several.

        A node that has acked a generation and lost its pod gets no new one while no resize is
        under way (that is a failure, see :meth:`problem`); during a resize it does (a pod
        re-created mid-resize starts on the new generation and acks it).

        ``pods``: the job's pods as the backend listed them just now (a start), else listed here.

        :raises BackendError: an API error other than 404/409.
        """
        b = self.backend
        target = b.broker.target(job.id)
        if target.status.terminal:
            return "wait"
        if not target.gpus:  # suspended: each pod's agent stops its trainer and acks its node
            if job.acked_generation < target.generation:  # a node whose pod is gone has no agent to ack
                self._ack_gone_nodes(job, target.generation, [], {g.node for g in job.in_use_gpus},
                                     b.pods(job.id) if pods is None else pods)
            return "wait"
        nodes = sorted({g.node for g in target.gpus})
        in_use_nodes = {g.node for g in job.in_use_gpus}
        resizing = job.acked_generation < target.generation
        if pods is None:
            pods = b.pods(job.id)
        self._ensure_service(job.id, context, made=bool(pods) or job.acked_generation >= 1)
        live = _live(pods)
        if any(pod_state(p).starting(b.config.startup_grace_s) for p in live) and b.may_keep_lease(job):
            b.broker.heartbeat(job.id)  # a node's pod has not started its agent yet (see KubernetesBackend._sync)
        done: list[str] = []
        deleted: list[Any] = []
        if b.config.resize_mechanism == "recreate":
            deleted = [p for p in live if generation_of(p) < target.generation]
            for pod in deleted:
                b._delete_pod(pod.metadata.name)
            if deleted:
                done.append("recreate")
            live = [p for p in live if p not in deleted]
        elif not resizing:
            deleted = [p for p in live if pod_node(p) not in nodes]
            for pod in deleted:  # its agent acked the suspension: the generation runs without it
                b._delete_pod(pod.metadata.name)
            if deleted:
                done.append("shrink")
        created = False
        # a deleted pod's trainer runs on through its grace period: a node gets its new pod only once
        # the job's old one there is gone (the new pod's ack would free GPUs the old trainer may use)
        listed = b.pods(job.id) if deleted else pods  # listed again only to see what this sync deleted
        terminating = {pod_node(p) for p in listed if p.metadata.deletion_timestamp is not None}
        for node in nodes:
            if any(pod_node(p) == node for p in live):
                continue
            if node in in_use_nodes and not resizing:
                continue  # lost while it ran: a failure of the gang, not a pod to re-create silently
            if node in terminating:
                done.append("wait")
                continue
            if not self._create_pod(job, node, target.generation, env, context):
                done.append("wait")  # a quota (tried again at the next sync), or the job was failed
                break
            created = True
        if created and "recreate" not in done:
            done.insert(0, "create")
        if resizing and in_use_nodes - set(nodes):  # nodes given up: are their pods gone?
            self._ack_gone_nodes(job, target.generation, nodes, in_use_nodes, b.pods(job.id))
        return "+".join(done) or "keep"

    def _ack_gone_nodes(self, job: JobView, generation: int, nodes: list[str], in_use_nodes: set[str],
                        pods: list[Any]) -> None:
        """Ack ``generation`` for every node the job gives up whose pod is gone from the API (not
        even terminating): nothing of the job runs there any more, and no agent is left to ack."""
        listed = {pod_node(p) for p in pods}
        for node in sorted(in_use_nodes - set(nodes) - listed):
            self.backend.broker.ack(job.id, generation, node=node)

    def _create_pod(self, job: JobView, node: str, generation: int, env: Mapping[str, str] | None,
                    context: Mapping[str, str] | None) -> bool:
        pod = self.builder.pod(job.id, job.command, node, generation, progress_pattern=job.progress_pattern,
                               checkpoint_dir=job.checkpoint_dir, env=env, context=context)
        return self.backend.create_pod(job, pod, others_run=True)

    def _ensure_service(self, job_id: str, context: Mapping[str, str] | None, *, made: bool = False) -> None:
        """Create the job's headless Service, once per backend (a sync runs every poll), unless it
        was ``made`` (the job has pods, or ran: its first sync made the Service before them; a
        re-creation leaves it without pods for a moment). A namespace at
        its ``services`` quota refuses a create of a Service that exists with 403, not 409 (the
        quota is checked first): a gang's every later backend (a triggerer restart, the trigger's
        new clients after a failed poll) failed its syncs, and the gang was LOST."""
        if job_id in self._services or made:
            self._services.add(job_id)
            return
        try:
            self.backend.core_v1.create_namespaced_service(self.namespace, self.builder.service(job_id, context))
        except ApiException as exc:
            if exc.status != 409:
                raise BackendError(f"cannot create the job's headless Service: {exc.status} {exc.reason}") from None
        self._services.add(job_id)

    def problem(self, job: JobView) -> Problem | None:
        """Why the gang cannot go on: one pod broken (evicted, failed, its trainer terminated, its
        image not pulled, Pending past ``startup_grace_s``), or the pod of a node that runs the acked generation gone from the API,
        or being deleted, while no resize is under way. Either fails the whole job."""
        listed = self.backend.pods(job.id)
        # nodes running the acked generation whose pod is gone (no resize under way): their GPUs stay
        # held until their agents report or the lease passes (a force deletion leaves containers running)
        # A pod being deleted counts as gone: one on a lost node stays listed, terminating, until the
        # node is deleted; the other nodes' agents keep the job's lease, so the gang hung with every GPU
        # (the target read again: a poll's own rebalance may have published a resize that this
        # poll's sync carried out, deleting the pods, since ``job`` was read)
        if (finished := self._finished(job, listed)) is not None:
            return Problem("every node's trainer had exited cleanly, and their agents are gone without reporting "
                           "it (the broker's API out of reach until the pods' grace period ended)",
                           gone=True, finished=finished)
        missing: list[str] = []
        if job.acked() and self.backend.broker.target(job.id).generation <= job.acked_generation:
            missing = sorted({g.node for g in job.in_use_gpus} - {pod_node(p) for p in _live(listed)})
        for pod in _live(listed):
            state = pod_state(pod)
            # a pod Pending too long too: its peers' agents heartbeat the job, so the lease would never end it
            if (reason := state.why_stopped(self.backend.config.startup_grace_s)) is not None:
                return Problem(f"{reason} (node {pod_node(pod)} of the gang; every pod of the job is stopped)",
                               node=pod_node(pod), running=state.trainer_running)
        if missing:
            pods_of = "the pod of node" if len(missing) == 1 else "the pods of nodes"
            # every GPU held (running) as for a single pod deleted from outside (a force deletion
            # leaves containers running); each node's agent that runs reports its trainer stopped
            return Problem(f"{pods_of} {', '.join(missing)} {'was' if len(missing) == 1 else 'were'} deleted "
                           "from outside the broker (every pod of the job is stopped)",
                           node=missing[0], running=True)
        return None

    def _finished(self, job: JobView, pods: list[Any]) -> dict[str, Any] | None:
        """The final metrics of a gang that finished unreported: a pod (not being deleted: the pods of
        nodes the gang dropped are) on every node of its allocation, each of whose trainers exited
        cleanly, its launcher's last word its clean exit (a stop on request also exits 0), as for
        one pod (:meth:`KubernetesBackend._clean_exit`), and rank 0's metrics among their logs;
        else None. Without the metrics it is no proof: the pod of rank 0, which prints them after
        the others have ended, may have been evicted while it evaluated."""
        live = _live(pods)
        if (not live or {g.node for g in job.in_use_gpus or job.target_gpus} - {pod_node(p) for p in live}
                or any(pod_state(p).trainer_exit_code != 0 for p in live)):
            return None
        metrics: dict[str, Any] = {}
        for pod in live:
            found = self.backend._clean_exit(job, pod.metadata.name)
            if found is None:
                return None
            metrics = metrics or found
        return metrics or None

    def log_pod(self, job_id: str) -> Any | None:
        """The pod whose trainer log tells the story: a broken one, else the first by node."""
        pods = sorted(self.backend.pods(job_id), key=lambda p: (pod_problem(p) is None, pod_node(p) or ""))
        return pods[0] if pods else None

    def delete_service(self, job_id: str) -> None:
        """Delete the job's headless Service (gone already: fine)."""
        try:
            self.backend.core_v1.delete_namespaced_service(service_name(job_id), self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete the job's headless Service: {exc.status} {exc.reason}") from None
        self._services.discard(job_id)
