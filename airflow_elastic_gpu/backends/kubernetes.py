"""Kubernetes backend: one training pod per job, with the stop-and-restart sidecar, pinned to the
broker's node.

Pod layout (see ``docs/kubernetes.md``):

* an init container (the agent image) copies the standard-library launcher (``launcher.py`` and
  ``protocol.py``) into a shared ``emptyDir`` mounted at ``/elastic``;
* the **agent** runs as a native sidecar (an init container with ``restartPolicy: Always``,
  Kubernetes >= 1.29): it talks to the broker's HTTP API with the job's bearer token, read on each
  request from a Secret created for the job (and deleted with it) and mounted into the agent only,
  and relays through ``/elastic/job``;
* the **trainer** container runs the user's image with the launcher as entry point:
  ``python /elastic/launcher.py --shared-dir /elastic/job -- COMMAND``. The launcher sets
  ``CUDA_VISIBLE_DEVICES`` to the broker's GPUs for each generation and restarts the trainer in
  place on a resize;
* the pod is pinned to the broker's node (``nodeName``) and sees all the node's GPUs through the
  NVIDIA container runtime (``runtimeClassName``, ``NVIDIA_VISIBLE_DEVICES=all``) without requesting
  ``nvidia.com/gpu``: the broker, not the kube-scheduler, owns GPU assignment on its nodes;
* hardened: every container runs as the same non-root user (``run_as_user``: the agent and the
  launcher share files), without privilege escalation or capabilities, under the runtime's seccomp
  profile; the agent and the init container with a read-only root filesystem; no service-account
  token is mounted. The trainer's ``securityContext`` can be replaced (``trainer_security_context``);
* the agent and the init container have small requests and limits (a namespace with a compute
  ResourceQuota refuses containers without them); the trainer's are ``container_resources``.

``resize_mechanism="recreate"`` is the termination-based baseline: a new generation deletes the pod
and creates a new one with the new GPU set (the pod's agent runs its own generation only, never a
newer one in place). A job whose GPUs move to another node is re-created in either mode. A job
larger than any node runs one pod per node and a headless Service (a gang, see
:mod:`.kubernetes_gang`).

The manifests are built by :class:`~.kubernetes_builder.PodBuilder` (pure), the pods read by
:mod:`.kubernetes_pods`. The Kubernetes API is reached through
``apache-airflow-providers-cncf-kubernetes``' ``KubernetesHook`` (``core_v1_client``); tests inject a
fake with the same methods.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_elastic_gpu.backends.base import BackendError, Problem, check_env
from airflow_elastic_gpu.backends.kubernetes_builder import TERMINATION_GRACE_S, PodBuilder
from airflow_elastic_gpu.backends.kubernetes_config import (  # noqa: F401 - re-exported: the backend's public names
    JOB_DIR,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_PREFIX,
    MANAGED_BY,
    SHARED,
    TOKEN_DIR,
    TOKEN_KEY,
    KubernetesJobConfig,
    label_value,
    resource_name,
    to_dict,
    with_request_timeout,
)
from airflow_elastic_gpu.backends.kubernetes_nodes import register_nodes_from_cluster  # noqa: F401 - re-exported
from airflow_elastic_gpu.backends.kubernetes_pods import (  # re-exported: the backend's public names
    REFUSED,
    PodState,
    _any_live,
    api_message,
    pod_log,
    pod_problem,  # noqa: F401 - re-exported
    pod_state,
)
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobView
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.logparse import LogParser

if TYPE_CHECKING:
    from airflow_elastic_gpu.backends.kubernetes_gang import GangPods

log = logging.getLogger(__name__)

CLEAN_EXIT_LOG_LINES = 200
"""Lines of a pod's trainer log read for its clean exit and final metrics (the trainer prints the
metrics just before it exits, and the launcher's exit note follows)."""


class KubernetesBackend:
    """Runs jobs as pods (the :class:`~airflow_elastic_gpu.backends.base.Backend` protocol).

    :param config: how pods are built.
    :param broker: the broker (job targets, tokens).
    :param core_v1: a ``CoreV1Api`` (default: from ``KubernetesHook(config.kubernetes_conn_id)``).
    """

    name = "kubernetes"

    def __init__(self, config: KubernetesJobConfig, broker: GpuBroker, core_v1: Any | None = None) -> None:
        self.config = config
        self.broker = broker
        self._core_v1 = core_v1
        self.builder = PodBuilder(config)
        self._gang_jobs: dict[str, bool] = {}  # job id -> runs as a gang (decided once per job)

    @cached_property
    def gang(self) -> GangPods:
        """The pods and Service of jobs on several nodes (:mod:`.kubernetes_gang`)."""
        from airflow_elastic_gpu.backends.kubernetes_gang import GangPods

        return GangPods(self)

    def is_gang(self, job: JobView, pods: list[Any] | None = None) -> bool:
        """True when ``job`` runs one pod per node: its command takes the gang's shape (every one of
        ``GANG_PLACEHOLDERS``: the broker may spread such a job over nodes at any rebalance, a node
        of its drained, say, so it runs one pod per node from its start, on one node too), or its
        ``max_gpus`` exceeds the healthy GPUs of every schedulable node of its pool (the rule of
        ``submit``), or its target spans nodes, or its pods say so already (a node added later
        changes nothing). ``pods``: the job's pods as :meth:`pods` lists them, if the caller has them."""
        if job.id not in self._gang_jobs:
            from airflow_elastic_gpu.backends.kubernetes_gang import LABEL_NODE

            if pods is None:
                pods = self.pods(job.id)
            if pods:
                self._gang_jobs[job.id] = any(LABEL_NODE in (p.metadata.labels or {}) for p in pods)
            else:
                largest = max((sum(g.healthy for g in n.gpus) for n in self.broker.nodes(job.pool) if n.schedulable),
                              default=0)
                spans = len({g.node for g in job.target_gpus}) > 1
                shaped = all(p in job.command for p in protocol.GANG_PLACEHOLDERS)
                self._gang_jobs[job.id] = shaped or spans or job.max_gpus > largest
        return self._gang_jobs[job.id]

    def for_job(self, job: JobView) -> KubernetesBackend:
        """This backend, or one like it in the namespace ``job`` was started in (its backend
        reference says which) when that is another: the orphan check stops a job of another
        task, whose pods, Service and token Secret a stop in this namespace would not find."""
        started_in = (job.backend_ref or "").removeprefix(f"{self.name}:").partition("/")[0]
        if not (job.backend_ref or "").startswith(f"{self.name}:") or started_in in ("", self.config.namespace):
            return self
        return KubernetesBackend(dataclasses.replace(self.config, namespace=started_in), self.broker, self._core_v1)

    @property
    def core_v1(self) -> Any:
        if self._core_v1 is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            self._core_v1 = with_request_timeout(KubernetesHook(conn_id=self.config.kubernetes_conn_id).core_v1_client)
        return self._core_v1

    def ensure_pool(self, pool: str) -> str | None:
        """Nothing to do: a cluster's GPU nodes are registered with ``airflow-elastic-gpu nodes
        kube-sync`` (:func:`register_nodes_from_cluster`)."""
        return None

    def check(self, command: str, checkpoint_dir: str | None) -> None:
        """:raises BackendError: an empty command, or a checkpoint dir that is not an absolute path
        (it is a path inside the container)."""
        if not command or not command.strip():
            raise BackendError("command must not be empty")
        if checkpoint_dir is not None and not checkpoint_dir.startswith("/"):
            raise BackendError(
                f"checkpoint_dir must be an absolute path in the container, got {checkpoint_dir!r}")

    # -- life cycle
    def start(self, job: JobView, *, env: Mapping[str, str] | None = None,
              context: Mapping[str, str] | None = None) -> str:
        """Create the job's token Secret (a fresh token) and, once the broker has placed it, its pod.

        Idempotent: while a pod of the job is pending or running (a retried task), nothing is
        changed: no new token is issued, so its agent keeps working with the one in the Secret.
        Otherwise an existing Secret is replaced with a fresh token (any agent still alive, say on
        a node that lost contact, re-reads its mounted token file on each request and follows) and
        the pod of the current generation is created if missing. Returns the backend reference
        stored in the broker.

        :raises BackendError: a bad command, env or checkpoint dir, a job started before in another
            namespace (its recorded reference names it: the DAG's ``namespace`` changed between two
            tries; its pods there run on), or an API error.
        """
        check_env(env)
        self.check(job.command, job.checkpoint_dir)
        started_in = self.for_job(job).config.namespace
        if started_in != self.config.namespace:
            raise BackendError(
                f"job {job.id} was started in namespace {started_in!r} ({job.backend_ref}), not in the configured "
                f"namespace {self.config.namespace!r}: its pods there may still run on its GPUs; set namespace "
                f"back to {started_in!r}, or cancel the job")
        ref = f"kubernetes:{self.config.namespace}/{resource_name('elastic-gpu', job.id)}"
        pods = self.pods(job.id)  # every pod of the job, a gang's too
        if _any_live(pods):
            return ref
        token = self.broker.issue_token(job.id)
        secret = self.builder.secret(job.id, token)
        try:
            self.core_v1.create_namespaced_secret(self.config.namespace, secret)
        except ApiException as exc:
            # a Secret of an earlier try: 409, or 403 in a namespace at its secrets quota (checked
            # before the existence), where replacing it is allowed
            over_quota = exc.status == 403 and "exceeded quota" in str(exc.body or "")
            if exc.status != 409 and not over_quota:
                raise BackendError(f"cannot create the job's token Secret: {exc.status} {exc.reason}") from None
            try:
                self.core_v1.replace_namespaced_secret(secret.metadata.name, self.config.namespace, secret)
            except ApiException as again:
                if not over_quota:
                    raise
                raise BackendError(f"cannot create the job's token Secret: {exc.status} {exc.reason} "
                                   f"({exc.body}; none to replace: {again.status} {again.reason})") from None
        self._sync(job, env, context, pods, starting=True)
        return ref

    def pods(self, job_id: str) -> list[Any]:
        """The job's pods (``V1Pod``), oldest generation first.

        :raises BackendError: the API server refused the listing (its status and message: RBAC
            without ``list`` on pods, an unknown namespace) or could not be reached."""
        try:
            found = self.core_v1.list_namespaced_pod(
                self.config.namespace, label_selector=f"{LABEL_JOB}={label_value(job_id)}").items
        except ApiException as exc:
            raise BackendError(f"cannot list job {job_id}'s pods in namespace {self.config.namespace!r}: "
                               f"{exc.status} {exc.reason}{api_message(exc)}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise BackendError(f"cannot list job {job_id}'s pods: the Kubernetes API server cannot be "
                               f"reached ({exc})") from exc
        return sorted(found, key=lambda p: int((p.metadata.labels or {}).get(LABEL_GENERATION, 0)))

    def state(self, job_id: str, pods: list[Any] | None = None) -> PodState | None:
        """The job's latest pod (``pods``: its pods as :meth:`pods` lists them, if the caller has
        them), or None when it has none."""
        if pods is None:
            pods = self.pods(job_id)
        if not pods:
            return None
        return pod_state(pods[-1])

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None) -> str:
        """Make the pods match the broker's target; returns what it did (``wait``, ``keep``,
        ``create``, ``recreate``).

        - no GPUs published yet: wait;
        - no pod: create it on the target's node;
        - the target moved to another node, or (``recreate`` mode) a new generation: delete the pod,
          and create one for the new generation once the old one is gone (``wait`` while it is
          still terminating: its trainer may still use the GPUs the new generation frees);
        - otherwise (in place): keep; the sidecar applies the new generation.

        A job on several nodes is synced as a gang (:meth:`.kubernetes_gang.GangPods.sync`).

        :raises BackendError: a target spanning nodes for a job that is no gang, or an API error
            other than 404/409.
        """
        return self._sync(job, env, context)

    def _sync(self, job: JobView, env: Mapping[str, str] | None, context: Mapping[str, str] | None,
              pods: list[Any] | None = None, *, starting: bool = False) -> str:
        """:meth:`sync`; ``pods``: the job's pods as :meth:`pods` listed them just now (one listing
        per call: the pods are listed again only after a deletion); ``starting``: called by
        :meth:`start` (a task's try, which makes a missing pod again, from the job's checkpoint)."""
        if self.is_gang(job, pods):
            return self.gang.sync(job, env=env, context=context, pods=pods)
        job_id = job.id
        target = self.broker.target(job_id)
        if target.status.terminal:
            return "wait"
        if not target.gpus:  # waiting for GPUs, or suspended: the pod's agent stops its trainer and acks
            if job.acked_generation < target.generation and not (self.pods(job_id) if pods is None else pods):
                # suspended with no pod left (deleted from outside, its node drained): no agent is
                # left to ack, and nothing of the job runs; unacked, the job held its GPUs until its
                # lease ended it (LOST) instead of resuming later
                self.broker.ack(job_id, target.generation)
            return "wait"
        nodes = {g.node for g in target.gpus}
        if len(nodes) > 1:
            raise BackendError(f"job {job_id} spans nodes {sorted(nodes)} but is not larger than a node")
        (node,) = nodes
        current = self.state(job_id, pods)
        if current is not None and current.starting(self.config.startup_grace_s) and self.may_keep_lease(job):
            # its containers have not started (scheduling, an image pull of minutes): no trainer runs
            # and no agent heartbeats yet, so the backend keeps the job's lease for the pod meanwhile
            # (for startup_grace_s at most; then problem() fails the job)
            self.broker.heartbeat(job_id)
        if current is not None and current.node == node and (
            self.config.resize_mechanism == "inplace" or current.generation >= target.generation
        ):
            return "keep"
        if current is None and not starting and job.acked(target.generation):
            # its agent runs this generation already: the pod was deleted from outside (kubectl, a
            # node removed). Made again it would hide that, and on a node that is gone it would be
            # made again and again, each new pod Pending and the job's lease kept: problem() fails it
            return "wait"
        action = "create" if current is None else "recreate"
        # A deleted pod's trainer runs on through its grace period (it checkpoints). The broker frees
        # the GPUs it ran on once the new pod's agent acks, so the new pod starts only once no other
        # pod of the job is left: on a later sync, while one is still terminating. (No pod listed:
        # nothing to delete or wait for.)
        if current is not None:
            self._delete_pod(current.name)
            if self.pods(job_id):
                return "wait"
        pod = self.builder.pod(job_id, job.command, node, target.generation,
                               progress_pattern=job.progress_pattern, checkpoint_dir=job.checkpoint_dir,
                               env=env, context=context)
        if self.create_pod(job, pod):
            return action
        if starting and job.acked(target.generation) and not self.broker.job(job_id).status.terminal:
            # a task's try that makes a missing pod again: a poll would take the missing pod for one
            # deleted from outside and fail the job; the try fails instead, and the next reattaches
            raise BackendError(f"cannot make job {job_id}'s pod {pod.metadata.name} again now (the API server is "
                               "busy or a quota is exceeded); the task's next try reattaches to the job")
        return "wait"

    def may_keep_lease(self, job: JobView) -> bool:
        """Whether the backend may still keep ``job``'s lease for a pod that has not started: for
        ``startup_grace_s`` since its generation was published, plus the trainer's stop grace (a
        resized job's new pod waits for the old one to be gone). A pod made again and again (one
        bound to a node that no longer exists, deleted by the pod garbage collector within a minute)
        is new each time: counted from its own creation, its start never ran out, and the job's
        lease was kept for ever."""
        if job.published_s is None:
            return True
        now = getattr(self.broker, "clock", time.time)()  # the broker's clock, as published_s is
        return now - job.published_s <= self.config.startup_grace_s + TERMINATION_GRACE_S

    def create_pod(self, job: JobView, pod: k8s.V1Pod, *, others_run: bool = False) -> bool:
        """Create ``pod`` of ``job`` (409, it exists already: a retried call, fine); False when it
        was not made: the API server is busy or away for a moment (429, 502-504, no connection: a
        500, such as an admission webhook that is down, is raised with its message) or a
        resource quota is exceeded (tried again at the next sync: the job's lease, from its
        placement, bounds the wait), or the API refused a started job's next pod for good (400, 403, 422: an admission
        policy, an invalid field), and the job was failed with the API's message rather than left
        holding GPUs with nothing on them (a first start's refusal: raised, ``start_job`` fails it).

        :param others_run: other pods of the job may still run their trainers (a gang): a refused
            job keeps every GPU held until they have stopped (their agents report it, or the lease).
        :raises BackendError: any other API error."""
        try:
            self.core_v1.create_namespaced_pod(self.config.namespace, pod)
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # the API server unreachable for a moment
            self._retry_later(job, f"cannot create pod {pod.metadata.name}: the Kubernetes API server cannot be "
                                   f"reached ({type(exc).__name__})", detail=str(exc))
            return False
        except ApiException as exc:
            if exc.status == 409:
                return True
            reason = f"cannot create pod {pod.metadata.name}: {exc.status} {exc.reason}{api_message(exc)}"
            if exc.status in (429, 502, 503, 504) or (exc.status == 403 and "exceeded quota" in reason):
                self._retry_later(job, reason)
                return False
            if exc.status in REFUSED and job.backend_ref is not None:
                self.broker.fail(job.id, reason, hold=others_run)
                return False
            raise BackendError(reason) from None
        return True

    def _retry_later(self, job: JobView, reason: str, detail: str = "") -> None:
        """Log ``reason`` (a pod not created for now; ``detail``, the error's text, in the log only:
        it may name objects by address, and the broker keeps one note per distinct reason) and record
        it with the broker (a ``backend`` event, named if the job is declared LOST before its agent
        ever reports: a quota that stays exceeded); best effort, the next sync tries the pod again."""
        log.warning("job %s: %s%s; trying again at the next poll", job.id, reason, f": {detail}" if detail else "")
        try:
            self.broker.note_problem(job.id, f"{reason}; trying again at the next poll")
        except Exception as exc:  # noqa: BLE001 - a note: the broker's database may be away too
            log.warning("job %s: could not record that with the broker (%s)", job.id, exc)

    def problem(self, job: JobView) -> Problem | None:
        """Why the job cannot go on, judged from its pods: a broken pod (see :func:`pod_problem`), or
        no pod although the job has GPUs and its agent has acked them (deleted from outside). A
        gang: any one pod's problem is the whole job's (:meth:`.kubernetes_gang.GangPods.problem`)."""
        if self.is_gang(job):
            return self.gang.problem(job)
        state = self.state(job.id)
        if state is not None and state.trainer_exit_code == 0 and (finished := self._clean_exit(job, state.name)) is not None:
            return Problem("the trainer had exited cleanly, and its agent is gone without reporting it (the "
                           "broker's API out of reach until the pod's grace period ended)", gone=True, finished=finished)
        if state is None:
            # (a resize or move under way, whose new pod is not made yet: no pod is expected)
            expected = bool(job.target_gpus) and job.acked()
            # its GPUs held (running): a pod force-deleted (grace 0, or by the pod garbage collector
            # after its node went away) leaves the API at once while its containers may run on; its
            # agent, if it runs, is told the job ended and reports the trainer stopped, else the lease
            return Problem("the job's pod was deleted from outside the broker", running=True) if expected else None
        reason = state.why_stopped(self.config.startup_grace_s)
        return None if reason is None else Problem(reason, running=state.trainer_running)

    def _clean_exit(self, job: JobView, pod_name: str) -> dict[str, Any] | None:
        """The final metrics (``{}`` when it printed none) of a trainer whose launcher's last word in
        the pod's log (``--echo``) is its clean exit; None otherwise (still running, stopped on
        request, which also exits 0, failed, or a log that cannot be read)."""
        try:
            text = pod_log(self.core_v1, pod_name, self.config.namespace, CLEAN_EXIT_LOG_LINES)
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            return None
        notes = protocol.launcher_notes(text)
        if not notes or notes[-1] != protocol.EXIT_NOTE.format(0):
            return None
        parser = LogParser(re.compile(job.progress_pattern) if job.progress_pattern else None)
        parser.feed(text + "\n")
        return parser.metrics or {}

    def is_running(self, job_id: str) -> bool:
        """True while a pod of the job (any node's, any generation's) is pending or running."""
        return _any_live(self.pods(job_id))

    def _delete_pod(self, name: str) -> None:
        try:
            self.core_v1.delete_namespaced_pod(name, self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete pod {name}: {exc.status} {exc.reason}") from None

    def stop(self, job_id: str, *, succeeded: bool = False, timeout_s: float | None = None) -> None:
        """Clean up as ``on_finish_action`` says (pods), and always delete the token Secret.
        ``timeout_s`` is not used: a deleted pod's containers get its termination grace period. A
        gang's pods go together (every node's, every generation's), and its headless Service always.
        Every deletion is tried, whatever an earlier one met (gone already, a 404: fine).

        :raises BackendError: one or more listings or deletions failed; the message names each."""
        from airflow_elastic_gpu.backends.kubernetes_gang import LABEL_NODE

        failed: list[str] = []
        action = self.config.on_finish_action
        try:
            pods = self.pods(job_id)
        except BackendError as exc:  # the Service and the Secret go all the same
            failed.append(str(exc))
            pods = []
        if action == "delete_pod" or (action == "delete_succeeded_pod" and succeeded):
            for pod in pods:
                _attempt(failed, f"cannot delete pod {pod.metadata.name}", self._delete_pod, pod.metadata.name)
        if job_id not in self._gang_jobs and not pods:
            # no pod left to tell (deleted by an earlier stop, or never made: a quota) and a backend
            # new to the job (a restarted triggerer, a task's on_kill): the broker's job tells
            try:
                self.is_gang(self.broker.job(job_id), pods)
            except Exception:  # noqa: BLE001 - not known (the broker away): a Service it may have had goes (a 404 is fine)
                self._gang_jobs[job_id] = True
        if self._gang_jobs.get(job_id) or any(LABEL_NODE in (p.metadata.labels or {}) for p in pods):
            _attempt(failed, "cannot delete the job's headless Service", self.gang.delete_service, job_id)
        _attempt(failed, "cannot delete the job's token Secret", self._delete_secret, job_id)
        if failed:
            raise BackendError(f"cannot clean up all of job {job_id} in namespace {self.config.namespace!r} "
                               f"(the rest was deleted): {'; '.join(failed)}")

    def _delete_secret(self, job_id: str) -> None:
        try:
            self.core_v1.delete_namespaced_secret(resource_name("elastic-gpu-token", job_id), self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete the job's token Secret: {exc.status} {exc.reason}") from None

    cleanup = stop

    def log_tail(self, job_id: str, lines: int = 20) -> list[str]:
        """The trainer's last log lines: of the newest pod, or a gang's broken pod (else its first)."""
        if self._gang_jobs.get(job_id):
            pod = self.gang.log_pod(job_id)
            name = None if pod is None else pod.metadata.name
        else:
            state = self.state(job_id)
            name = None if state is None else state.name
        if name is None:
            return []
        try:
            text = pod_log(self.core_v1, name, self.config.namespace, lines)
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            return []
        return text.splitlines()[-lines:]


def _attempt(failed: list[str], what: str, delete: Any, *args: Any) -> None:
    """Call ``delete(*args)``; an API error (:class:`BackendError`) or an API server out of reach
    is added to ``failed`` (``what`` and the reason) instead of raised, so that the next one is tried."""
    try:
        delete(*args)
    except BackendError as exc:
        failed.append(str(exc))
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        failed.append(f"{what}: the Kubernetes API server cannot be reached ({exc})")
