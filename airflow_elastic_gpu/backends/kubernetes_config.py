"""The settings of a job's pods (:class:`KubernetesJobConfig`, checked at DAG parse time) and the
names and labels the Kubernetes backend gives its resources."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_elastic_gpu.backends.base import BackendError

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


REQUEST_TIMEOUT_S = (10.0, 60.0)
"""Connect and read time-outs of every call the Kubernetes backend makes (seconds): the client sets
none, and a call to an API server that accepted the connection and never answered waited for ever."""


def with_request_timeout(core_v1: Any, timeout_s: float | tuple[float, float] = REQUEST_TIMEOUT_S) -> Any:
    """``core_v1`` (a ``CoreV1Api``) whose calls that name no ``_request_timeout`` get ``timeout_s``.

    :returns: ``core_v1`` itself (its ``api_client``'s ``call_api`` wrapped)."""
    api = core_v1.api_client
    call = api.call_api

    def call_api(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = timeout_s
        return call(*args, **kwargs)

    api.call_api = call_api
    return core_v1


@functools.cache
def _api_client() -> Any:
    """The Kubernetes client's (de)serializer, made on first use: the settings are checked when a
    DAG is parsed, which does not import the client until a setting needs it.

    :raises ImportError: the ``kubernetes`` client is not installed."""
    from kubernetes.client import ApiClient

    return ApiClient()


def to_dict(obj: Any) -> dict[str, Any]:
    """A Kubernetes model as the JSON the API server receives (camelCase keys, no ``None``)."""
    return _api_client().sanitize_for_serialization(obj)


def model(kind: str, data: dict[str, Any]) -> Any:
    """A Kubernetes model (``V1Toleration``, ``V1Volume``...) from its JSON form.

    :raises ValueError: a required field missing or a value out of its range."""
    class Response:
        def __init__(self, d: dict[str, Any]) -> None:
            self.data = json.dumps(d)

    return _api_client().deserialize(Response(data), kind)


def _check_fields(where: str, kind: str, given: dict[str, Any]) -> None:
    """:raises BackendError: ``given`` (a Kubernetes object in its JSON form, of model ``kind``)
    has a field the model does not know, at any depth (it would be dropped without a word: a
    volume's source given as ``persistent_volume_claim`` made the volume an empty directory)."""
    try:
        kept = to_dict(model(kind, given))
    except ImportError:  # checked where the backend runs, which needs the client
        return
    except (ValueError, TypeError) as exc:
        raise BackendError(f"{where}: not a valid {kind[2:]}: {exc}") from None
    if lost := _lost_fields(given, kept):
        known = _known_fields(kind, lost)
        raise BackendError(f"{where}: unknown field {lost!r} of a {kind[2:]} (Kubernetes' JSON form: camelCase"
                           + (f"; known there: {', '.join(known)})" if known else ")"))


def _known_fields(kind: str, path: str) -> list[str]:
    """The field names (JSON form) the model ``kind`` knows where ``path`` (a dotted path of JSON
    names, list items as ``[i]``, as :func:`_lost_fields` gives it) ends, or ``[]`` if not a model there."""
    from kubernetes.client import models

    cls = getattr(models, kind, None)
    for name in [re.sub(r"\[\d+\]$", "", part) for part in path.split(".")][:-1]:
        attrs = {v: k for k, v in getattr(cls, "attribute_map", {}).items()}
        inner = re.fullmatch(r"(?:list\[)?(\w+)\]?", getattr(cls, "openapi_types", {}).get(attrs.get(name), ""))
        cls = getattr(models, inner.group(1), None) if inner else None
    return sorted(getattr(cls, "attribute_map", {}).values())


def _asks_for_gpus(limits: Any, requests: Any) -> bool:
    """Whether a container's resource ``limits`` or ``requests`` (mappings, or None) name ``nvidia.com/gpu``."""
    return any("nvidia.com/gpu" in k for k in {**(limits or {}), **(requests or {})})


def _lost_fields(given: Any, kept: Any, path: str = "") -> str | None:
    """The path of the first key of ``given`` missing from ``kept`` (dicts and lists compared in step)."""
    if isinstance(given, dict):
        for key, value in given.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(kept, dict) or key not in kept:
                if value is None:
                    continue  # an explicit null is dropped by design
                return where
            if (lost := _lost_fields(value, kept[key], where)) is not None:
                return lost
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (g, k) in enumerate(zip(given, kept, strict=False)):
            if (lost := _lost_fields(g, k, f"{path}[{i}]")) is not None:
                return lost
    return None


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
    :param container_resources: the trainer's ``resources`` in Kubernetes' JSON form (``requests``,
        ``limits``: cpu/memory; never ``nvidia.com/gpu``).
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
        agent's user (a root trainer's files are not readable by the agent). A field of either that
        Kubernetes does not know is refused (the API server would drop it).
    :param startup_grace_s: seconds a pod may stay Pending (scheduling, pulling its images,
        mounting its volumes) before that fails the job (>= 0; default 600); meanwhile the backend
        keeps the job's heartbeat lease, since its agent has not started (counted from the
        generation's publication, plus the old pod's termination grace).
    :param rendezvous_port: a job on several nodes (one pod per node): the TCP port of the
        rendezvous at the pod of node rank 0 (``{master_port}`` in the command; 1-65535).
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
    startup_grace_s: float = 600.0
    rendezvous_port: int = 29500

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
        port = self.rendezvous_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise BackendError(f"rendezvous_port must be a TCP port number (1-65535), got {port!r}")
        for name, kind in (("tolerations", "V1Toleration"), ("volumes", "V1Volume"), ("volume_mounts", "V1VolumeMount")):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
                raise BackendError(f"{name} must be a list of dicts (Kubernetes objects in their JSON form), "
                                   f"got {value!r}")
            for i, item in enumerate(value):
                _check_fields(f"{name}[{i}]", kind, item)
            object.__setattr__(self, name, tuple(value))
        if sourceless := [v.get("name") for v in self.volumes if not set(v) - {"name"}]:
            raise BackendError(f"volumes: {sourceless[0]!r} has no source (persistentVolumeClaim, hostPath, "
                               "emptyDir...): the API server would make it an empty directory")
        pulls = self.image_pull_secrets
        if not isinstance(pulls, (list, tuple)) or not all(isinstance(n, str) and n for n in pulls):
            raise BackendError(f"image_pull_secrets must be a list of Secret names, got {pulls!r}")
        object.__setattr__(self, "image_pull_secrets", tuple(pulls))
        for name in ("container_resources", "full_pod_spec", "trainer_security_context"):
            if not isinstance(getattr(self, name), (dict, type(None))):
                raise BackendError(f"{name} must be a dict (Kubernetes' JSON form) or None, "
                                   f"got {getattr(self, name)!r}")
        for name, kind in (("container_resources", "V1ResourceRequirements"),
                           ("trainer_security_context", "V1SecurityContext")):
            if getattr(self, name):  # a misspelt field was dropped: no limits, or the hardened default gone
                _check_fields(name, kind, getattr(self, name))
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
        resources = self.container_resources or {}
        if _asks_for_gpus(resources.get("limits"), resources.get("requests")):
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


UNMAPPED = "none"
"""The ``map_index`` label of an unmapped task (its map index ``-1``)."""


def context_label(key: str, value: str) -> str:
    """The label value of a task's ``key`` (``dag_id``, ``task_id``, ``map_index``): ``value`` as
    :func:`label_value` makes it, but an unmapped task's map index ``-1`` is :data:`UNMAPPED`
    (stripped of its ``-`` it read as map index 1)."""
    if key == "map_index" and value == "-1":
        return UNMAPPED
    return label_value(value)


def resource_name(prefix: str, job_id: str, generation: int | None = None) -> str:
    """A DNS-1123 name: ``{prefix}-{job id}[-g{generation}]``."""
    name = f"{prefix}-{job_id}".lower()
    if generation is not None:
        name += f"-g{generation}"
    return re.sub(r"[^a-z0-9-]", "-", name)[:63].strip("-")


def read_pod_template(path: str) -> dict[str, Any]:
    """The pod of ``pod_template_file`` ``path`` (YAML or JSON), as a dict.

    :raises BackendError: the file is missing or unreadable on this host (named), not YAML, or not a
        mapping. (Airflow's ``PodGenerator.deserialize_model_file`` only logs a warning for a missing
        file and returns an empty pod: every pod was then built without the template.)"""
    import socket

    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise BackendError(f"pod_template_file {path!r} cannot be read on host {socket.gethostname()!r}: "
                           f"{exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise BackendError(f"pod_template_file {path!r} is not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise BackendError(f"pod_template_file {path!r} holds no pod (a YAML mapping), got {type(data).__name__}")
    return data


def with_pod_template_read(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``pod_template_file`` read into ``full_pod_spec`` (unless that is set): read
    where the task runs, so that the pods a trigger builds later (a resize by re-creation, a move to
    another node, a gang's growth) need no copy of the file in the triggerer.

    :raises BackendError: as :func:`read_pod_template`."""
    path = settings.get("pod_template_file")
    if not path or settings.get("full_pod_spec") is not None:
        return settings
    return {**settings, "pod_template_file": None, "full_pod_spec": read_pod_template(path)}


def checked_merge(pod: Any, c: KubernetesJobConfig) -> Any:
    """``pod`` (a ``V1Pod``) merged with ``pod_template_file`` or ``full_pod_spec``, held to the settings' own
    checks: the merge lets the template's values win where the generated ones read as unset.

    :raises BackendError: a container of the template requests ``nvidia.com/gpu`` (the device
        plugin would hand out GPUs beside the broker's), or the template has a volume of the
        backend's own names."""
    spec = pod.spec
    spec.automount_service_account_token = c.automount_service_account_token  # False reads as unset
    for container in [*(spec.init_containers or []), *(spec.containers or [])]:
        resources = container.resources
        if resources is not None and _asks_for_gpus(resources.limits, resources.requests):
            raise BackendError(f"the pod template's container {container.name!r} requests nvidia.com/gpu: the broker "
                               "assigns GPUs on its nodes; take it out of the template")
    names = [v.name for v in spec.volumes or []]
    if doubled := sorted({n for n in names if n in RESERVED_VOLUMES and names.count(n) > 1}):
        raise BackendError(f"the pod template has a volume named {doubled[0]!r}, the backend's own; choose another")
    return pod
