"""What the Kubernetes backend reads from a job's pods: whether one is alive, the latest one's
state (its node, generation, phase, how long it has been Pending) and why a pod can no longer
train (eviction, a failed phase, a container that cannot start or was killed)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import models as k8s

from airflow_elastic_gpu.backends.kubernetes_config import LABEL_GENERATION


def _named(node: str) -> k8s.V1NodeSelectorRequirement:
    """The requirement of a node selector term that selects ``node`` by its name."""
    return k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])


def pin_to(node: str) -> k8s.V1Affinity:
    """The affinity that puts a pod on ``node`` through the scheduler (as DaemonSets' pods are put):
    a required node affinity on the node's name (``matchFields`` ``metadata.name``). Not
    ``nodeName``, which skips the scheduler: a checkpoint claim of a ``WaitForFirstConsumer``
    storage class (the default on EKS, GKE, AKS) then never binds and its pod stays Pending, and a
    pod the node has no CPU or memory for fails (``OutOfcpu``) instead of waiting."""
    return k8s.V1Affinity(node_affinity=k8s.V1NodeAffinity(
        required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[
            k8s.V1NodeSelectorTerm(match_fields=[_named(node)])])))


def pin_within(affinity: Any | None, node: str) -> k8s.V1Affinity:
    """A pod template's ``affinity`` (``V1Affinity`` or None) pinned to ``node`` as :func:`pin_to`
    pins: the node's name is added to each of its required node selector terms (terms are ORed,
    a term's requirements ANDed), and its preferences, pod affinity and anti-affinity are kept."""
    if affinity is None:
        return pin_to(node)
    out = copy.deepcopy(affinity)
    required = out.node_affinity.required_during_scheduling_ignored_during_execution if out.node_affinity else None
    if required is None or not required.node_selector_terms:
        out.node_affinity = out.node_affinity or k8s.V1NodeAffinity()
        out.node_affinity.required_during_scheduling_ignored_during_execution = \
            pin_to(node).node_affinity.required_during_scheduling_ignored_during_execution
    else:
        for term in required.node_selector_terms:
            term.match_fields = [*(term.match_fields or []), _named(node)]
    return out


def pod_node(pod: Any) -> str | None:
    """The node ``pod`` (a ``V1Pod`` the backend made) runs on or is pinned to (:func:`pin_to`):
    its ``nodeName`` once scheduled; before, the node its affinity names."""
    if pod.spec.node_name:
        return pod.spec.node_name
    affinity = pod.spec.affinity.node_affinity if pod.spec.affinity is not None else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity is not None else None
    for term in required.node_selector_terms if required is not None else []:
        for field in reversed(term.match_fields or []):  # ours is the last (:func:`pin_within`)
            if field.key == "metadata.name" and field.operator == "In" and len(field.values or []) == 1:
                return field.values[0]
    return None


def _any_live(pods: list[Any]) -> bool:
    """True if one of ``pods`` (``V1Pod``) is pending or running (or has no phase yet)."""
    return any((p.status.phase if p.status else None) in ("Pending", "Running", None) for p in pods)


@dataclass(frozen=True)
class PodState:
    """What the backend sees of a job's pod: its name, node, generation, phase and a problem, if any."""

    name: str
    node: str | None
    generation: int
    phase: str
    problem: str | None = None
    pending_s: float | None = None  # seconds since it was created, while Pending
    trainer_running: bool = False  # its trainer container runs (whatever its agent does)
    trainer_exit_code: int | None = None  # its trainer container's, once terminated
    pulling: str | None = None  # Pending, an image not pulled yet (:func:`pull_error`) or not scheduled

    def why_stopped(self, grace_s: float) -> str | None:
        """Why the pod can no longer train (:func:`pod_problem`), or why it will not start: Pending
        for longer than ``grace_s`` seconds (not scheduled, or its images, named if the kubelet
        could not pull them, or its volumes cannot be had); ``None`` if neither."""
        if self.problem is None and self.pending_s is not None and self.pending_s > grace_s:
            why = self.pulling or "not scheduled, or its images or volumes cannot be had"
            return f"pod {self.name} has been Pending for {self.pending_s:.0f}s (startup_grace_s {grace_s:g}s): {why}"
        return self.problem

    def starting(self, grace_s: float) -> bool:
        """Pending without a problem (its agent not started yet: scheduling, an image pull) for at
        most ``grace_s`` seconds since it was created (a pod without a creation time: yes)."""
        return self.phase == "Pending" and self.problem is None and (self.pending_s or 0.0) <= grace_s


def pod_state(pod: Any) -> PodState:
    """:class:`PodState` of ``pod`` (a ``V1Pod`` the backend made: it has the generation label)."""
    phase = (pod.status.phase if pod.status else None) or "Pending"
    created = pod.metadata.creation_timestamp
    pending_s = (datetime.now(UTC) - created).total_seconds() if phase == "Pending" and created else None
    return PodState(pod.metadata.name, pod_node(pod), int(pod.metadata.labels.get(LABEL_GENERATION, 0)),
                    phase, pod_problem(pod), pending_s, trainer_running(pod), trainer_exit_code(pod),
                    pull_error(pod) or unschedulable(pod))


def _trainer_state(pod: Any) -> Any | None:
    """``pod``'s trainer container state (``V1ContainerState``) as the kubelet reports it, or None."""
    statuses = (pod.status.container_statuses or []) if pod.status else []
    return next((cs.state for cs in statuses if cs.name == "trainer" and cs.state is not None), None)


def trainer_exit_code(pod: Any) -> int | None:
    """The exit code of ``pod``'s trainer container once it has terminated, else None."""
    state = _trainer_state(pod)
    return state.terminated.exit_code if state is not None and state.terminated is not None else None


LOG_LIMIT_BYTES = 65536
"""The most of a pod's log read at once (a progress bar redrawn with ``\r`` is one long line)."""


def pod_log(core_v1: Any, name: str, namespace: str, lines: int) -> str:
    """The last ``lines`` lines of ``name``'s trainer container log, decoded: fewer where they are
    more than :data:`LOG_LIMIT_BYTES`, always up to the log's end. The kubelet reads ``limit_bytes``
    from the first of the last ``tail_lines`` lines on (``ReadLogs``), so a tail larger than the
    limit lost its newest lines (a clean exit's last line among them): the tail is asked again, a
    quarter as long, until it fits. The client's own decoding gives ``str(bytes)`` for this call (one
    line, escaped), so the raw response is read.

    :raises ApiException: the API server refused (the pod gone, RBAC); a connection error."""
    while True:
        text = _read_log(core_v1, name, namespace, lines)
        if lines <= 1 or len(text.encode("utf-8", "replace")) < LOG_LIMIT_BYTES:
            return text
        lines = max(1, lines // 4)  # never 0: the kubelet answers tailLines=0 with nothing


def _read_log(core_v1: Any, name: str, namespace: str, lines: int) -> str:
    resp = core_v1.read_namespaced_pod_log(name, namespace, container="trainer", tail_lines=lines,
                                           limit_bytes=LOG_LIMIT_BYTES, _preload_content=False)
    if isinstance(resp, str):  # a client (or a stand-in) that decoded it
        return resp
    try:
        data = resp.data
    finally:
        getattr(resp, "release_conn", lambda: None)()
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


def trainer_running(pod: Any) -> bool:
    """Whether ``pod``'s trainer container runs (``V1Pod``; its status as the kubelet reports it)."""
    state = _trainer_state(pod)
    return state is not None and state.running is not None


# a container waiting for one of these will not start without a change to the pod or its images
# (not CreateContainerError or RunContainerError: the kubelet retries those, and they often pass)
_CANNOT_START = ("CreateContainerConfigError", "InvalidImageName")
# nor for one of these if it lasts: the kubelet retries a pull with back-off (a registry's 429 or 503
# passes), so a Pending pod's pull error is a problem only past startup_grace_s (PodState.why_stopped)
_PULL_FAILED = ("ErrImagePull", "ImagePullBackOff")


AGENT_CRASHES = 3
"""Restarts after which an agent container in ``CrashLoopBackOff`` is a pod's problem: the kubelet
restarts a native sidecar that exits (10 s, 20 s, 40 s of back-off), but one that keeps crashing
(killed at its memory limit, a broker API it cannot use) never reports, and a Pending pod of it
kept the job's lease for ``startup_grace_s``, its reason then blaming scheduling or volumes."""


AGENT_CRASH_RUN_S = 600.0
"""A run of the agent shorter than this (the kubelet's own back-off reset) counts as a crash loop's:
one killed now and then over days of a job's life has a restart count, but ran for long."""


def _crash_looping(cs: Any) -> str | None:
    waiting = cs.state.waiting if cs.state is not None else None
    if (cs.name != "elastic-agent" or waiting is None or waiting.reason != "CrashLoopBackOff"
            or (cs.restart_count or 0) < AGENT_CRASHES):
        return None
    last = cs.last_state.terminated if cs.last_state is not None else None
    if last is not None and last.started_at and last.finished_at and (
            last.finished_at - last.started_at).total_seconds() >= AGENT_CRASH_RUN_S:
        return None  # it ran long before this exit: the kubelet restarts it, as any sidecar
    why = f"{last.reason or 'exited'} (exit code {last.exit_code})" if last is not None else "CrashLoopBackOff"
    return f"{cs.name} container keeps crashing: {why}, restarted {cs.restart_count} times"


def _containers(status: Any) -> list[Any]:
    """The statuses of the agent (an init container: a native sidecar), then of the trainer."""
    return [*(status.init_container_statuses or []),
            *(cs for cs in status.container_statuses or [] if cs.name == "trainer")]


def _cannot_start(cs: Any, reasons: tuple[str, ...]) -> str | None:
    waiting = cs.state.waiting if cs.state is not None else None
    if waiting is None or waiting.reason not in reasons:
        return None
    return f"{cs.name} container cannot start: {waiting.reason}: {waiting.message or ''}".strip()


def pull_error(pod: Any) -> str | None:
    """Why an image of ``pod`` (a ``V1Pod``, Pending) is not pulled yet (``ErrImagePull``,
    ``ImagePullBackOff``), or ``None``: the kubelet retries the pull with back-off."""
    status = pod.status
    if status is None or (status.phase or "Pending") != "Pending":
        return None
    return next((why for cs in _containers(status) if (why := _cannot_start(cs, _PULL_FAILED))), None)


def unschedulable(pod: Any) -> str | None:
    """Why the scheduler has not placed ``pod`` (a ``V1Pod``, Pending): its ``PodScheduled=False``
    condition's message (``0/12 nodes are available: 1 Insufficient cpu ...``), or ``None``."""
    status = pod.status
    if status is None or (status.phase or "Pending") != "Pending":
        return None
    return next((f"not scheduled: {c.message or c.reason}" for c in status.conditions or []
                 if c.type == "PodScheduled" and c.status == "False" and (c.message or c.reason)), None)


def pod_problem(pod: Any) -> str | None:
    """Why ``pod`` (a ``V1Pod``) can no longer train, or ``None``: eviction, a failed phase, a
    terminated trainer (OOMKilled, Error), an agent that keeps crashing (:data:`AGENT_CRASHES`), an
    invalid image name, or an image not pulled in a pod
    that has started (a sidecar restarted; a Pending pod's pull is retried: :func:`pull_error`)."""
    status = pod.status
    if status is None:
        return None
    if status.reason == "Evicted" or (status.phase == "Failed" and status.reason):
        return f"pod {pod.metadata.name} {status.reason or 'failed'}: {status.message or ''}".strip()
    started = (status.phase or "Pending") != "Pending"
    for cs in _containers(status):
        if cs.state is None:
            continue
        if why := _cannot_start(cs, _CANNOT_START + _PULL_FAILED if started else _CANNOT_START) or _crash_looping(cs):
            return why
        if cs.name == "trainer" and cs.state.terminated and cs.state.terminated.reason in (
                "OOMKilled", "Error", "ContainerCannotRun", "StartError"):
            t = cs.state.terminated
            return f"trainer container terminated: {t.reason} (exit code {t.exit_code})"
    if status.phase == "Failed":
        return f"pod {pod.metadata.name} failed"
    return None


REFUSED = (400, 403, 422)
"""API answers to a pod's creation that no retry changes: bad request, forbidden (RBAC, an admission
policy, a resource quota), invalid."""


def api_message(exc: Any) -> str:
    """``": "`` and the message of the API server's ``Status`` in the body of ``exc`` (an
    ``ApiException``), or ``""``."""
    try:
        message = json.loads(exc.body or "").get("message")
    except (ValueError, TypeError, AttributeError):
        return ""
    return f": {message}" if isinstance(message, str) and message else ""
