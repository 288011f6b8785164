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
  token is mounted. The trainer's ``securityContext`` can be replaced (``trainer_security_context``).

``resize_mechanism="recreate"`` is the termination-based baseline: a new generation deletes the pod
and creates a new one with the new GPU set. A job whose GPUs move to another node is re-created in
either mode. Jobs larger than one node (one pod per node) are not supported yet: submit rejects
them.

The Kubernetes API is reached through ``apache-airflow-providers-cncf-kubernetes``'
``KubernetesHook`` (``core_v1_client``); tests inject a fake with the same methods.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kubernetes.client import ApiClient, models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_elastic_gpu.backends.base import BackendError, Problem, check_env
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobView

MANAGED_BY = "airflow-elastic-gpu"
LABEL_PREFIX = "elastic-gpu.airflow.apache.org/"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = f"{LABEL_PREFIX}job-id"
LABEL_GENERATION = f"{LABEL_PREFIX}generation"
SHARED = "/elastic"
JOB_DIR = f"{SHARED}/job"
TOKEN_KEY = "token"
TOKEN_DIR = "/var/run/secrets/elastic-gpu"
RESERVED_VOLUMES = ("elastic", "elastic-token")
RESIZE_MECHANISMS = ("inplace", "recreate")
ON_FINISH = ("delete_pod", "delete_succeeded_pod", "keep_pod")
_COPY_LAUNCHER = (
    "import os, shutil, airflow_elastic_gpu.sidecar as s; d = os.path.dirname(s.__file__); "
    f"[shutil.copy(os.path.join(d, f), '{SHARED}') for f in ('launcher.py', 'protocol.py')]; "
    f"os.makedirs('{JOB_DIR}', exist_ok=True)"
)
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def hardened_security_context(*, read_only_root: bool) -> dict[str, Any]:
    """A container ``securityContext`` (Kubernetes' JSON form) that meets the "restricted" Pod
    Security Standard: non-root, no privilege escalation, every capability dropped, the runtime's
    default seccomp profile; ``read_only_root``: a read-only root filesystem."""
    context: dict[str, Any] = {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                               "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    if read_only_root:
        context["readOnlyRootFilesystem"] = True
    return context


@dataclass(frozen=True)
class KubernetesJobConfig:
    """How a job's pod is built; JSON-serializable (it travels to the trigger).

    :param image: the training image (needs ``python3``; the launcher is copied in).
    :param agent_image: image with this package installed (the agent and the launcher's source).
    :param broker_api_url: the broker HTTP API as seen from pods, e.g. ``http://elastic-gpu-broker:8793``.
    :param namespace: where pods and secrets go.
    :param kubernetes_conn_id: Airflow connection for ``KubernetesHook``.
    :param resize_mechanism: ``"inplace"`` (sidecar restart) or ``"recreate"`` (new pod per generation).
    :param on_finish_action: ``"delete_pod"``, ``"delete_succeeded_pod"`` or ``"keep_pod"`` (as in KPO).
    :param runtime_class_name: the NVIDIA runtime class (``None``: the node's default runtime).
    :param pod_template_file: a pod YAML merged under the generated spec (as KPO's).
    :param full_pod_spec: a pod dict merged under the generated spec.
    :param image_pull_secrets: secret names.
    :param container_resources: the trainer's ``resources`` (cpu/memory; never ``nvidia.com/gpu``).
    :param tolerations, volumes, volume_mounts: as in the pod spec (dicts in Kubernetes' JSON form).
    :param labels, annotations: extra metadata; keys under ``elastic-gpu.airflow.apache.org/`` and
        ``app.kubernetes.io/managed-by`` are the backend's own (it finds a job's pods by them) and
        are refused.
    :param service_account_name: the pod's service account.
    :param automount_service_account_token: mount the service account's API token into the pod
        (off: neither the trainer nor the agent needs the Kubernetes API).
    :param run_as_user, run_as_group: the uid and gid every container of the pod runs as (the
        agent and the launcher share files of mode 0600, so they must be the same user), also the
        pod's ``fsGroup``; >= 1 (not root). ``None``: the images' own users.
    :param trainer_security_context: the trainer container's ``securityContext`` in Kubernetes' JSON
        form, replacing the default (:func:`hardened_security_context` without a read-only root),
        e.g. to add ``SYS_PTRACE`` for a profiler; ``{}``: none. The trainer must still run as the
        agent's user (a root trainer's files are not readable by the agent).
    :param startup_grace_s: seconds a pod may take to appear before it counts as missing (>= 0).
    :raises BackendError: a bad setting; the message names it.
    """

    image: str
    agent_image: str = "airflow-elastic-gpu-agent:latest"
    broker_api_url: str = "http://elastic-gpu-broker:8793"
    namespace: str = "default"
    kubernetes_conn_id: str = "kubernetes_default"
    resize_mechanism: str = "inplace"
    on_finish_action: str = "delete_pod"
    runtime_class_name: str | None = "nvidia"
    pod_template_file: str | None = None
    full_pod_spec: dict[str, Any] | None = None
    image_pull_secrets: tuple[str, ...] = ()
    container_resources: dict[str, Any] | None = None
    tolerations: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account_name: str | None = None
    automount_service_account_token: bool = False
    run_as_user: int | None = 1000
    run_as_group: int | None = 1000
    trainer_security_context: dict[str, Any] | None = None
    startup_grace_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.image:
            raise BackendError("backend='kubernetes' needs an image for the trainer")
        if not isinstance(self.image, str):
            raise BackendError(f"image must be a string, got {self.image!r}")
        if not isinstance(self.namespace, str) or len(self.namespace) > 63 or not _DNS_LABEL.fullmatch(
                self.namespace):
            raise BackendError(
                f"namespace must be a DNS-1123 label (at most 63 lowercase letters, digits and '-', "
                f"starting and ending with a letter or digit), got {self.namespace!r}")
        grace = self.startup_grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (0 <= grace < math.inf):
            raise BackendError(f"startup_grace_s must be a number of seconds >= 0, got {grace!r}")
        for name in ("tolerations", "volumes", "volume_mounts"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
                raise BackendError(f"{name} must be a list of dicts (Kubernetes objects in their JSON form), "
                                   f"got {value!r}")
            object.__setattr__(self, name, tuple(value))
        pulls = self.image_pull_secrets
        if not isinstance(pulls, (list, tuple)) or not all(isinstance(n, str) and n for n in pulls):
            raise BackendError(f"image_pull_secrets must be a list of Secret names, got {pulls!r}")
        object.__setattr__(self, "image_pull_secrets", tuple(pulls))
        for name in ("container_resources", "full_pod_spec", "trainer_security_context"):
            if not isinstance(getattr(self, name), (dict, type(None))):
                raise BackendError(f"{name} must be a dict (Kubernetes' JSON form) or None, "
                                   f"got {getattr(self, name)!r}")
        taken = [v.get("name") for v in self.volumes if v.get("name") in RESERVED_VOLUMES]
        if taken:
            raise BackendError(f"volumes: the name {taken[0]!r} is the backend's own; choose another")
        _check_metadata("labels", self.labels, values_are_labels=True)
        _check_metadata("annotations", self.annotations, values_are_labels=False)
        for name in ("run_as_user", "run_as_group"):
            uid = getattr(self, name)
            if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or not 1 <= uid < 2**31):
                raise BackendError(f"{name} must be an integer >= 1 (not root) or None, got {uid!r}")
        if not isinstance(self.automount_service_account_token, bool):
            raise BackendError("automount_service_account_token must be True or False, "
                               f"got {self.automount_service_account_token!r}")
        if self.resize_mechanism not in RESIZE_MECHANISMS:
            raise BackendError(f"resize_mechanism must be one of {', '.join(RESIZE_MECHANISMS)}, "
                               f"got {self.resize_mechanism!r}")
        if self.on_finish_action not in ON_FINISH:
            raise BackendError(f"on_finish_action must be one of {', '.join(ON_FINISH)}, got {self.on_finish_action!r}")
        if not self.broker_api_url.startswith(("http://", "https://")):
            raise BackendError(f"broker_api_url must start with http:// or https://, got {self.broker_api_url!r}")
        limits = {**((self.container_resources or {}).get("limits") or {}),
                  **((self.container_resources or {}).get("requests") or {})}
        if any("nvidia.com/gpu" in k for k in limits):
            raise BackendError("do not request nvidia.com/gpu: the broker assigns GPUs on its nodes "
                               "(the pod sees them through the NVIDIA runtime)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KubernetesJobConfig:
        """The config :meth:`to_dict` gave (lists where it had tuples)."""
        return cls(**data)


def _check_metadata(what: str, items: Any, *, values_are_labels: bool) -> None:
    """:raises BackendError: ``items`` is not a dict of strings, a key is not a valid (prefixed)
    name or is one of the backend's own, or (labels) a value is not a valid label value."""
    if not isinstance(items, dict):
        raise BackendError(f"{what} must be a dict of strings, got {items!r}")
    for key, value in items.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BackendError(f"{what} must be a dict of strings, got {key!r}: {value!r}")
        if key.startswith(LABEL_PREFIX) or key == LABEL_MANAGED_BY:
            raise BackendError(f"{what}: {key!r} is set by airflow-elastic-gpu (it finds and tells apart "
                               "a job's pods by it) and cannot be overridden; choose another key")
        prefix, _, name = key.rpartition("/")
        if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name) or (
                prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix))):
            raise BackendError(f"{what}: {key!r} is not a valid key ([prefix/]name, name at most 63 "
                               "characters of [A-Za-z0-9._-])")
        if values_are_labels and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
            raise BackendError(f"{what}[{key!r}]: {value!r} is not a valid label value (at most 63 "
                               "characters of [A-Za-z0-9._-], starting and ending with a letter or digit)")


def label_value(text: str) -> str:
    """``text`` as a valid label value (<= 63 chars of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", text).strip("-._")
    if len(clean) > 63:
        clean = clean[:54].rstrip("-._") + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return clean or "x"


def resource_name(prefix: str, job_id: str, generation: int | None = None) -> str:
    """A DNS-1123 name: ``{prefix}-{job id}[-g{generation}]``."""
    name = f"{prefix}-{job_id}".lower()
    if generation is not None:
        name += f"-g{generation}"
    return re.sub(r"[^a-z0-9-]", "-", name)[:63].strip("-")


_api = ApiClient()


def to_dict(obj: Any) -> dict[str, Any]:
    """A Kubernetes model as the JSON the API server receives (camelCase keys, no ``None``)."""
    return _api.sanitize_for_serialization(obj)


def _model(kind: str, data: dict[str, Any]) -> Any:
    """A Kubernetes model (``V1Toleration``, ``V1Volume``...) from its JSON form."""
    class Resp:
        def __init__(self, d: dict[str, Any]) -> None:
            import json

            self.data = json.dumps(d)

    return _api.deserialize(Resp(data), kind)


class PodBuilder:
    """Builds the job's Secret and Pod (pure: no API calls)."""

    def __init__(self, config: KubernetesJobConfig) -> None:
        self.config = config

    def secret(self, job_id: str, token: str) -> k8s.V1Secret:
        return k8s.V1Secret(
            api_version="v1", kind="Secret",
            metadata=k8s.V1ObjectMeta(name=resource_name("elastic-gpu-token", job_id),
                                      namespace=self.config.namespace, labels=self._labels(job_id, None, {})),
            type="Opaque", string_data={TOKEN_KEY: token},
        )

    def _labels(self, job_id: str, generation: int | None, context: dict[str, str]) -> dict[str, str]:
        """The user's labels, then the backend's own (last, so that nothing overrides them)."""
        labels = {**self.config.labels,
                  **{f"{LABEL_PREFIX}{k}": label_value(v) for k, v in context.items()},
                  LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: label_value(job_id)}
        if generation is not None:
            labels[LABEL_GENERATION] = str(generation)
        return labels

    def pod(self, job_id: str, command: str, node: str, generation: int, *,
            progress_pattern: str | None = None, checkpoint_dir: str | None = None,
            env: Mapping[str, str] | None = None, context: Mapping[str, str] | None = None) -> k8s.V1Pod:
        """The pod of ``job_id``'s ``generation`` on ``node``.

        :param context: dag_id, task_id, run_id, map_index... (labels and annotations).

        The job's token is a Secret volume mounted into the agent only, which reads the file on
        each request: a token rotated in the Secret reaches a running agent (the kubelet refreshes
        the file within its sync period) and the trainer never sees it.
        """
        c = self.config
        context = dict(context or {})
        shared_mount = k8s.V1VolumeMount(name="elastic", mount_path=SHARED)
        user_mounts = [_model("V1VolumeMount", m) for m in c.volume_mounts]
        agent_args = ["--job-id", job_id, "--shared-dir", JOB_DIR, "--broker-api", c.broker_api_url,
                      "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}", "--poll-s", "2"]
        if progress_pattern:
            agent_args += ["--progress-pattern", progress_pattern]
        sidecar_context = _model("V1SecurityContext", hardened_security_context(read_only_root=True))
        copy_launcher = k8s.V1Container(
            name="copy-launcher", image=c.agent_image, command=["python", "-c", _COPY_LAUNCHER],
            volume_mounts=[shared_mount], security_context=sidecar_context)
        agent = k8s.V1Container(
            name="elastic-agent", image=c.agent_image, restart_policy="Always",
            command=["python", "-m", "airflow_elastic_gpu.sidecar.agent"], args=agent_args,
            volume_mounts=[shared_mount, k8s.V1VolumeMount(name="elastic-token", mount_path=TOKEN_DIR,
                                                           read_only=True)],
            security_context=sidecar_context,
            resources=k8s.V1ResourceRequirements(requests={"cpu": "50m", "memory": "128Mi"}))
        trainer_context = (hardened_security_context(read_only_root=False) if c.trainer_security_context is None
                           else c.trainer_security_context)
        launcher_args = ["--shared-dir", JOB_DIR]
        if checkpoint_dir:
            launcher_args += ["--checkpoint-dir", checkpoint_dir]
        trainer = k8s.V1Container(
            name="trainer", image=c.image, command=["python3", f"{SHARED}/launcher.py"],
            args=[*launcher_args, "--", command],
            env=[k8s.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="all"),
                 *(k8s.V1EnvVar(name=k, value=v) for k, v in sorted((env or {}).items()))],
            volume_mounts=[shared_mount, *user_mounts],
            security_context=_model("V1SecurityContext", trainer_context) if trainer_context else None,
            resources=_model("V1ResourceRequirements", c.container_resources) if c.container_resources else None)
        token_volume = k8s.V1Volume(name="elastic-token", secret=k8s.V1SecretVolumeSource(
            secret_name=resource_name("elastic-gpu-token", job_id),
            default_mode=0o440 if c.run_as_group is not None else 0o444))  # fsGroup: readable by the agent
        pod = k8s.V1Pod(
            api_version="v1", kind="Pod",
            metadata=k8s.V1ObjectMeta(
                name=resource_name("elastic-gpu", job_id, generation), namespace=c.namespace,
                labels=self._labels(job_id, generation, {k: v for k, v in context.items() if k != "run_id"}),
                annotations={**c.annotations, **{f"{LABEL_PREFIX}{k}": v for k, v in context.items()},
                             LABEL_JOB: job_id}),
            spec=k8s.V1PodSpec(
                node_name=node, restart_policy="Never", runtime_class_name=c.runtime_class_name,
                init_containers=[copy_launcher, agent], containers=[trainer],
                volumes=[k8s.V1Volume(name="elastic", empty_dir=k8s.V1EmptyDirVolumeSource()), token_volume,
                         *(_model("V1Volume", v) for v in c.volumes)],
                tolerations=[_model("V1Toleration", t) for t in c.tolerations] or None,
                image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in c.image_pull_secrets] or None,
                service_account_name=c.service_account_name,
                automount_service_account_token=c.automount_service_account_token,
                security_context=k8s.V1PodSecurityContext(
                    run_as_user=c.run_as_user, run_as_group=c.run_as_group, fs_group=c.run_as_group,
                    fs_group_change_policy="OnRootMismatch" if c.run_as_group is not None else None,
                    seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
                termination_grace_period_seconds=120,
            ),
        )
        if c.pod_template_file or c.full_pod_spec:  # Airflow's pod generator, only when it is needed
            from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator

            pod = PodGenerator.reconcile_pods(self._template(), pod)
        return pod

    def _template(self) -> k8s.V1Pod:
        """The base pod of ``pod_template_file`` or ``full_pod_spec`` (one of them is set)."""
        from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator

        c = self.config
        if c.pod_template_file:
            return PodGenerator.deserialize_model_file(c.pod_template_file)
        return PodGenerator.deserialize_model_dict(c.full_pod_spec)


@dataclass(frozen=True)
class PodState:
    """What the backend sees of a job's pod: its name, node, generation, phase and a problem, if any."""

    name: str
    node: str | None
    generation: int
    phase: str
    problem: str | None = None


def pod_problem(pod: Any) -> str | None:
    """Why ``pod`` (a ``V1Pod``) can no longer train, or ``None``: eviction, a failed phase, a
    terminated trainer (OOMKilled, Error), an unpullable image."""
    status = pod.status
    if status is None:
        return None
    if status.reason == "Evicted" or (status.phase == "Failed" and status.reason):
        return f"pod {pod.metadata.name} {status.reason or 'failed'}: {status.message or ''}".strip()
    for cs in status.container_statuses or []:
        if cs.name != "trainer" or cs.state is None:
            continue
        if cs.state.waiting and cs.state.waiting.reason in ("ErrImagePull", "ImagePullBackOff",
                                                            "CreateContainerConfigError", "InvalidImageName"):
            return f"trainer container cannot start: {cs.state.waiting.reason}: {cs.state.waiting.message or ''}".strip()
        if cs.state.terminated and cs.state.terminated.reason in ("OOMKilled", "Error", "ContainerCannotRun"):
            t = cs.state.terminated
            return f"trainer container terminated: {t.reason} (exit code {t.exit_code})"
    if status.phase == "Failed":
        return f"pod {pod.metadata.name} failed"
    return None


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

    @property
    def core_v1(self) -> Any:
        if self._core_v1 is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            self._core_v1 = KubernetesHook(conn_id=self.config.kubernetes_conn_id).core_v1_client
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

        :raises BackendError: a bad command, env or checkpoint dir, or an API error.
        """
        check_env(env)
        self.check(job.command, job.checkpoint_dir)
        ref = f"kubernetes:{self.config.namespace}/{resource_name('elastic-gpu', job.id)}"
        if self.is_running(job.id):
            return ref
        token = self.broker.issue_token(job.id)
        secret = self.builder.secret(job.id, token)
        try:
            self.core_v1.create_namespaced_secret(self.config.namespace, secret)
        except ApiException as exc:
            if exc.status != 409:
                raise BackendError(f"cannot create the job's token Secret: {exc.status} {exc.reason}") from None
            self.core_v1.replace_namespaced_secret(secret.metadata.name, self.config.namespace, secret)
        self.sync(job, env=env, context=context)
        return ref

    def pods(self, job_id: str) -> list[Any]:
        """The job's pods (``V1Pod``), oldest generation first."""
        found = self.core_v1.list_namespaced_pod(
            self.config.namespace, label_selector=f"{LABEL_JOB}={label_value(job_id)}").items
        return sorted(found, key=lambda p: int((p.metadata.labels or {}).get(LABEL_GENERATION, 0)))

    def state(self, job_id: str) -> PodState | None:
        pods = self.pods(job_id)
        if not pods:
            return None
        pod = pods[-1]
        return PodState(pod.metadata.name, pod.spec.node_name,
                        int(pod.metadata.labels.get(LABEL_GENERATION, 0)),
                        (pod.status.phase if pod.status else None) or "Pending", pod_problem(pod))

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None) -> str:
        """Make the pods match the broker's target; returns what it did (``wait``, ``keep``,
        ``create``, ``recreate``).

        - no GPUs published yet: wait;
        - no pod: create it on the target's node;
        - the target moved to another node, or (``recreate`` mode) a new generation: delete the pod,
          create one for the new generation;
        - otherwise (in place): keep; the sidecar applies the new generation.

        :raises BackendError: a target spanning nodes, or an API error other than 404/409.
        """
        job_id = job.id
        target = self.broker.target(job_id)
        if target.status.terminal or not target.gpus:
            return "wait"
        nodes = {g.node for g in target.gpus}
        if len(nodes) > 1:
            raise BackendError(f"job {job_id} spans nodes {sorted(nodes)}: one pod per node is not supported yet")
        (node,) = nodes
        current = self.state(job_id)
        if current is not None and current.node == node and (
            self.config.resize_mechanism == "inplace" or current.generation >= target.generation
        ):
            return "keep"
        action = "create" if current is None else "recreate"
        if current is not None:
            self._delete_pod(current.name)
        pod = self.builder.pod(job_id, job.command, node, target.generation,
                               progress_pattern=job.progress_pattern, checkpoint_dir=job.checkpoint_dir,
                               env=env, context=context)
        try:
            self.core_v1.create_namespaced_pod(self.config.namespace, pod)
        except ApiException as exc:
            if exc.status != 409:  # 409: this generation's pod exists already (a retried call)
                raise BackendError(f"cannot create pod {pod.metadata.name}: {exc.status} {exc.reason}") from None
        return action

    def problem(self, job: JobView) -> Problem | None:
        """Why the job cannot go on, judged from its pods: a broken pod (see :func:`pod_problem`), or
        no pod although the job has GPUs and its agent has acked them (deleted from outside)."""
        state = self.state(job.id)
        if state is None:
            expected = bool(job.target_gpus) and job.acked_generation >= 1
            return Problem("the job's pod was deleted from outside the broker") if expected else None
        return None if state.problem is None else Problem(state.problem)

    def is_running(self, job_id: str) -> bool:
        """True while the job's newest pod is pending or running."""
        state = self.state(job_id)
        return state is not None and state.phase in ("Pending", "Running")

    def _delete_pod(self, name: str) -> None:
        try:
            self.core_v1.delete_namespaced_pod(name, self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete pod {name}: {exc.status} {exc.reason}") from None

    def stop(self, job_id: str, *, succeeded: bool = False, timeout_s: float | None = None) -> None:
        """Clean up as ``on_finish_action`` says (pods), and always delete the token Secret.
        ``timeout_s`` is not used: a deleted pod's containers get its termination grace period."""
        action = self.config.on_finish_action
        if action == "delete_pod" or (action == "delete_succeeded_pod" and succeeded):
            for pod in self.pods(job_id):
                self._delete_pod(pod.metadata.name)
        try:
            self.core_v1.delete_namespaced_secret(resource_name("elastic-gpu-token", job_id), self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete the job's token Secret: {exc.status} {exc.reason}") from None

    cleanup = stop

    def log_tail(self, job_id: str, lines: int = 20) -> list[str]:
        state = self.state(job_id)
        if state is None:
            return []
        try:
            text = self.core_v1.read_namespaced_pod_log(state.name, self.config.namespace, container="trainer",
                                                        tail_lines=lines)
        except ApiException:
            return []
        return str(text).splitlines()[-lines:]


def register_nodes_from_cluster(broker: GpuBroker, core_v1: Any, *, pool: str = "default",
                                label_selector: str | None = "nvidia.com/gpu.present=true") -> list[str]:
    """Register every GPU node of the cluster in ``pool``: GPU count from the ``nvidia.com/gpu.count``
    label (GPU feature discovery) or the ``nvidia.com/gpu`` capacity, type from ``nvidia.com/gpu.product``.

    :returns: the registered node names.
    """
    names = []
    for node in core_v1.list_node(label_selector=label_selector).items:
        labels = node.metadata.labels or {}
        count = labels.get("nvidia.com/gpu.count") or (node.status.capacity or {}).get("nvidia.com/gpu")
        if not count or int(count) < 1:
            continue
        broker.register_node(node.metadata.name, int(count), pool=pool,
                             gpu_type=labels.get("nvidia.com/gpu.product", "nvidia"))
        names.append(node.metadata.name)
    return names
