"""What the Kubernetes backend reads from a job's pods: whether one is alive, the latest one's
state (its node, generation, phase, how long it has been Pending) and why a pod can no longer
train (eviction, a failed phase, a container that cannot start or was killed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def pod_problem(pod: Any) -> str | None:
    """Why ``pod`` (a ``V1Pod``) can no longer train, or ``None``: eviction, a failed phase, a
    terminated trainer (OOMKilled, Error), an unpullable image."""
    status = pod.status
    if status is None:
        return None
    if status.reason == "Evicted" or (status.phase == "Failed" and status.reason):
        return f"pod {pod.metadata.name} {status.reason or 'failed'}: {status.message or ''}".strip()
    for cs in status.init_container_statuses or []:  # the agent (a native sidecar)
        if cs.state is not None and cs.state.waiting and cs.state.waiting.reason in (
                "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "InvalidImageName"):
            return f"{cs.name} container cannot start: {cs.state.waiting.reason}: {cs.state.waiting.message or ''}".strip()
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
