"""The CoreV1Api calls the Kubernetes backend makes, served by podman (``podman kube play``).

:class:`PodmanCoreV1` lets the project's own :class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesBackend`
create, watch and delete real pods on this host. The generated manifest is played as it is, except
for what podman 4.3 cannot express (see :func:`podman_manifest`). Each pod has its own network
namespace (:data:`NETWORK`). A deleted pod's container logs are kept (with podman's timestamps)
for the measurements of ``run_job.py``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_elastic_gpu.backends.kubernetes import to_dict
from airflow_elastic_gpu.backends.kubernetes_pods import pod_node

NETWORK = "slirp4netns:allow_host_loopback=true"
"""The pod's network: its own namespace (own IP; ``/etc/hosts`` names the pod, as the kubelet's
does), and the host's loopback reachable at :data:`HOST_FROM_POD`, so that the broker API on the
host can listen on 127.0.0.1 only."""
HOST_FROM_POD = "10.0.2.2"
_STAMPED = re.compile(r"(?P<time>[0-9-]+T[0-9:]+)(?:\.(?P<fraction>\d+))?(?P<zone>Z|[+-]\d\d:\d\d) (?P<line>.*)")


def podman_env() -> dict[str, str]:
    conf = Path(__file__).resolve().parent / "containers.conf"
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(conf))}


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=podman_env(), text=True, capture_output=True, check=check)


def podman_manifest(pod: dict[str, Any], secrets_dir: Path) -> dict[str, Any]:
    """The nearest pod podman 4.3's ``kube play`` runs faithfully, from the generated ``pod`` (JSON form).

    - A native sidecar (an init container with ``restartPolicy: Always``) would block: podman runs
      init containers to completion, one after another, before the app containers. It becomes an
      app container beside the trainer, started before it (same image, command, env, mounts);
      what is lost is the ordering guarantee (the trainer's launcher waits for the agent's files
      anyway) and the sidecar's termination after the trainer (the agent exits by itself once it
      has reported the trainer's exit).
    - A ``secret`` volume becomes a ``hostPath`` directory holding the same key file (podman 4.3
      maps secret volumes to its own secret store, not to Secret objects created through the API).
    - The node ``affinity`` and ``runtimeClassName`` are dropped (one host, the default runtime);
      the pod is bound to its node as the scheduler binds it (``nodeName``, as read back).
    - ``$$`` and ``$(NAME)`` in ``command``, ``args`` and env values are replaced as the kubelet
      does (podman 4.3 passes them as written).
    """
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    spec["initContainers"] = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"]
    for sidecar in sidecars:
        sidecar.pop("restartPolicy")
    spec["containers"] = [*sidecars, *spec["containers"]]
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            name = volume.pop("secret")["secretName"]
            volume["hostPath"] = {"path": str(secrets_dir / name), "type": "Directory"}
    spec.pop("affinity", None)
    spec.pop("runtimeClassName", None)
    for container in [*spec["initContainers"], *spec["containers"]]:
        environ: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                var["value"] = environ[var["name"]] = kubelet_expand(var["value"], environ)
        for field in ("command", "args"):
            if field in container:
                container[field] = [kubelet_expand(a, environ) for a in container[field]]
    return pod


def kubelet_expand(value: str, environ: dict[str, str]) -> str:
    """``value`` as the kubelet passes a container's ``command``/``args`` item or env value: ``$$`` is
    one ``$``, ``$(NAME)`` the value of an env var defined before it, else left as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else environ.get(m.group(1), m.group(0)), value)


class Listing:
    def __init__(self, items: list[Any]) -> None:
        self.items = items


def log_lines(text: str) -> list[tuple[float, str]]:
    """``podman logs --timestamps`` output (RFC 3339 with nanoseconds) as ``(epoch seconds, line)``
    pairs: the time podman read each line from the container."""
    out = []
    for raw in text.splitlines():
        m = _STAMPED.match(raw)
        if m:
            zone = "+00:00" if m["zone"] == "Z" else m["zone"]
            when = datetime.fromisoformat(f"{m['time']}.{(m['fraction'] or '0').ljust(6, '0')[:6]}{zone}")
            out.append((when.timestamp(), m["line"]))
    return out


class PodmanCoreV1:
    """The ``CoreV1Api`` methods :class:`KubernetesBackend` calls, on this host's podman.

    :param work_dir: where Secrets (as files) and the played manifests go.
    :param run_as_user: owner of the Secret files (the pod's ``runAsUser``).

    Recorded for measurements (epoch seconds): ``created_at`` (``kube play`` called),
    ``deleted_at`` (deletion called), ``delete_s`` (seconds the deletion took: the containers'
    SIGTERM, their grace, removal) and ``logs`` (each deleted pod's ``podman logs --timestamps``
    text by container name).
    """

    def __init__(self, work_dir: Path, run_as_user: int = 1000) -> None:
        self.work_dir = work_dir
        self.secrets_dir = work_dir / "secrets"
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        self.run_as_user = run_as_user
        self.pods: dict[str, k8s.V1Pod] = {}
        self.created_at: dict[str, float] = {}
        self.deleted_at: dict[str, float] = {}
        self.delete_s: dict[str, float] = {}
        self.logs: dict[str, dict[str, str]] = {}

    # -- secrets: one directory per Secret, one file per key
    def create_namespaced_secret(self, namespace: str, body: k8s.V1Secret) -> None:
        if (self.secrets_dir / body.metadata.name).exists():
            raise ApiException(status=409, reason="AlreadyExists")
        self.replace_namespaced_secret(body.metadata.name, namespace, body)

    def replace_namespaced_secret(self, name: str, namespace: str, body: k8s.V1Secret) -> None:
        folder = self.secrets_dir / name
        folder.mkdir(exist_ok=True)
        for key, value in (body.string_data or {}).items():
            path = folder / key
            path.write_text(value)
            os.chown(path, self.run_as_user, self.run_as_user) if os.geteuid() == 0 else None
            path.chmod(0o440)

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        folder = self.secrets_dir / name
        if not folder.exists():
            raise ApiException(status=404, reason="NotFound")
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()

    # -- pods
    def create_namespaced_pod(self, namespace: str, body: k8s.V1Pod) -> None:
        name = body.metadata.name
        if name in self.pods:
            raise ApiException(status=409, reason="AlreadyExists")
        manifest = podman_manifest(to_dict(body), self.secrets_dir)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=self.work_dir, delete=False) as f:
            yaml.safe_dump(manifest, f)
        self.created_at[name] = time.time()
        done = podman("kube", "play", "--network", NETWORK, f.name, check=False)
        if done.returncode != 0:
            podman("pod", "rm", "--force", name, check=False)  # a half-played pod
            raise ApiException(status=500, reason=f"podman kube play failed: {done.stderr.strip()[-600:]}")
        self.pods[name] = copy.deepcopy(body)
        self.pods[name].spec.node_name = pod_node(body)  # scheduled where its affinity pins it
        self.pods[name].metadata.creation_timestamp = datetime.fromtimestamp(self.created_at[name], UTC)

    def delete_namespaced_pod(self, name: str, namespace: str) -> None:
        """Terminate the pod in the kubelet's order: its main containers, then its native sidecars in
        reverse order, each with SIGTERM and what is left of the pod's
        ``terminationGracePeriodSeconds`` before SIGKILL; then the pod's sandbox (podman's infra
        container, which holds the network namespace). Keep the containers' logs."""
        pod = self.pods.pop(name, None)
        if pod is None:
            raise ApiException(status=404, reason="NotFound")
        grace_s = pod.spec.termination_grace_period_seconds or 30
        sidecars = [c.name for c in pod.spec.init_containers or [] if c.restart_policy == "Always"]
        self.deleted_at[name] = time.time()
        deadline = time.monotonic() + grace_s
        for container in [*(c.name for c in pod.spec.containers), *reversed(sidecars)]:
            left_s = max(0, math.ceil(deadline - time.monotonic()))
            podman("stop", "--time", str(left_s), f"{name}-{container}", check=False)
        podman("pod", "stop", "--time", "0", name, check=False)
        self.delete_s[name] = time.time() - self.deleted_at[name]
        containers = [c.name for c in [*(pod.spec.init_containers or []), *pod.spec.containers]]
        self.logs[name] = {c: podman("logs", "--timestamps", f"{name}-{c}", check=False).stdout for c in containers}
        started = time.time()
        podman("pod", "rm", "--force", name, check=False)
        self.delete_s[name] += time.time() - started

    def delete_all(self) -> None:
        """Delete every pod still here (clean-up, also after a failure)."""
        for name in list(self.pods):
            self.delete_namespaced_pod(name, "default")

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Listing:
        key, value = label_selector.split("=", 1)
        found = [p for p in self.pods.values() if (p.metadata.labels or {}).get(key) == value]
        for pod in found:
            pod.status = self.status(pod.metadata.name)
        return Listing(found)

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str, tail_lines: int, **_: Any) -> str:
        return podman("logs", "--tail", str(tail_lines), f"{name}-{container}", check=False).stdout

    def status(self, name: str) -> k8s.V1PodStatus:
        """The pod's phase from its trainer container's state (podman's pod states differ from
        Kubernetes' phases): a container still stopping is Running (its exit code, 0 until it has
        exited, is not yet its end), and one that cannot be inspected now (podman's lock busy, or
        removed under the pod) Unknown, as a pod whose node does not answer: its agent's lease
        decides."""
        done = podman("container", "inspect", f"{name}-trainer", check=False)
        if done.returncode != 0:
            return k8s.V1PodStatus(phase="Unknown")
        state = json.loads(done.stdout)[0]["State"]
        return pod_status_of(state)

    def trainer_log(self, name: str) -> list[tuple[float, str]]:
        """The trainer container's log lines of pod ``name`` (deleted or not) with their times."""
        text = self.logs.get(name, {}).get("trainer")
        if text is None:
            text = podman("logs", "--timestamps", f"{name}-trainer", check=False).stdout
        return log_lines(text)


def pod_status_of(state: dict[str, Any]) -> k8s.V1PodStatus:
    """A pod's status from its trainer container's ``podman container inspect`` ``State``."""
    if state["Status"] in ("created", "configured", "initialized"):
        return k8s.V1PodStatus(phase="Pending")
    if state["Status"] in ("running", "paused", "stopping", "removing"):
        return k8s.V1PodStatus(phase="Running")
    code = int(state.get("ExitCode") or 0)
    terminated = k8s.V1ContainerStateTerminated(exit_code=code, reason="Completed" if code == 0 else "Error")
    return k8s.V1PodStatus(phase="Succeeded" if code == 0 else "Failed", container_statuses=[
        k8s.V1ContainerStatus(name="trainer", image="", image_id="", ready=False, restart_count=0,
                              state=k8s.V1ContainerState(terminated=terminated))])
