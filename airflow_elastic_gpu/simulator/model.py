"""What the simulator assumes besides the trace and the speeds: the cluster's shape and the cost of a resize.

A resize costs training time, and how much depends on the mechanism:

* **in place** (the sidecar restarts the trainer in its pod): the median measured with real
  containers by ``benchmarks/recreate_overhead.py`` (publication, SIGTERM, checkpoint, exit, restart,
  resume), one number;
* **re-creation** (termination-based resizing: the pod is deleted and a new one created): a
  model of the pod's life, :class:`RecreateModel`. The old pod holds its GPUs without training
  until it is gone (the *stop* part: the grace period), then the new pod goes back through
  scheduling and, once it has GPUs, holds them without training while it is bound, pulls its
  image, starts its containers and initialises the framework (the *start* part).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from airflow_elastic_gpu.scheduling.state import NodeState

# Defaults from real containers (benchmarks/recreate_overhead.py, benchmarks/results/recreate_overhead.json:
# the generated pod run with podman on one host, image cached, medians of 10 resizes on 2026-11-25, after
# the harness fix; docs/benchmarks.md, section 1). In place: a new generation published -> the first step
# after the trainer container's restart in the same pod (inplace_s).
DEFAULT_INPLACE_RESTART_S = 7.2
# Re-creation, part by part (docs/simulator.md, "Restart overhead", gives each source). The old pod's
# termination, measured: deletion -> its containers stopped (SIGTERM, checkpoint, exit) and removed
# (pod_delete_s); Kubernetes' terminationGracePeriodSeconds (30 s by default) only bounds it.
DEFAULT_GRACE_PERIOD_S = 1.9
# Of the in-place restart, the part during which the trainer still holds its old GPUs: SIGTERM, the
# checkpoint and the exit, before its agent acks the new generation. The same trainer's stop measured
# in the re-creation (pod_delete_s, DEFAULT_GRACE_PERIOD_S); the agent's reaction (its heartbeat, up to
# 2 s in a pod) is left out, as the backend's reaction to a re-creation is.
DEFAULT_INPLACE_STOP_S = DEFAULT_GRACE_PERIOD_S
# Binding the new pod: not measured (one host, no scheduler); with the container start, inside
# Kubernetes' pod start-up SLO (sig-scalability, "Pod startup latency": <= 5 s at the 99th percentile).
DEFAULT_SCHEDULING_S = 1.0
# Container creation and start, measured: a pod played -> its first step (pod_start_s, 5.1 s) less the
# trainer's initialisation (DEFAULT_COLD_START_S, measured outside containers): on one host with the
# image cached, creating and starting the containers costs next to nothing.
DEFAULT_CONTAINER_START_S = 0.1
# The project's trainer image (docker/Dockerfile.train, CPU PyTorch), as built: 1,290 MiB.
DEFAULT_IMAGE_SIZE_MB = 1290 * 1.048576
# An assumption, not a measurement: a 1 Gbit/s link to the registry (125 MB/s).
DEFAULT_PULL_BANDWIDTH_MB_S = 125.0
# The cold start measured by benchmarks/resize_overhead.py: launch -> first step on 2 GPUs.
DEFAULT_COLD_START_S = 5.0
MECHANISMS = ("inplace", "recreate", "none")


class SimulationError(ValueError):
    """Bad simulator input (cluster shape, overheads, a job the cluster can never run)."""


def _check_non_negative(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
            raise SimulationError(f"restart overhead {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ClusterShape:
    """``nodes`` nodes of ``gpus_per_node`` GPUs each."""

    nodes: int
    gpus_per_node: int
    gpu_type: str = "T4"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise SimulationError(
                f"a cluster needs >= 1 node of >= 1 GPU, got {self.nodes}x{self.gpus_per_node}"
            )

    @classmethod
    def parse(cls, text: str, gpu_type: str = "T4") -> ClusterShape:
        """``"4x4"`` -> 4 nodes of 4 GPUs.

        :raises SimulationError: anything but ``NODESxGPUS`` with positive integers.
        """
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
        if not m:
            raise SimulationError(
                f"cluster shape must look like NODESxGPUS_PER_NODE, e.g. 4x4, got {text!r}"
            )
        return cls(int(m.group(1)), int(m.group(2)), gpu_type)

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_states(self) -> tuple[NodeState, ...]:
        width = len(str(self.nodes - 1))
        return tuple(
            NodeState(f"node-{i:0{width}d}", tuple(range(self.gpus_per_node)), self.gpu_type)
            for i in range(self.nodes)
        )

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


@dataclass(frozen=True)
class RecreateModel:
    """Seconds one termination-based resize costs a job, part by part (defaults: the module constants).

    :param grace_period_s: the old pod's termination: it keeps its GPUs, not training, this long.
    :param scheduling_s: the new pod's binding once GPUs are free for it.
    :param image_cached: the trainer image is on the node (``IfNotPresent``, one image for every
        job); if False the pull takes ``image_size_mb / pull_bandwidth_mb_s``.
    :param image_size_mb: the image's size, MB (10^6 bytes).
    :param pull_bandwidth_mb_s: registry -> node, MB/s (> 0).
    :param container_start_s: container creation and start (init container and sidecar included).
    :param init_s: the trainer's initialisation up to its first step (framework, data, checkpoint).
    :param total_s: if set, the whole cost, overriding the parts: the stop part is
        ``min(grace_period_s, total_s)``, the start part the rest.
    :raises SimulationError: a negative or non-finite value, or a zero bandwidth.
    """

    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    scheduling_s: float = DEFAULT_SCHEDULING_S
    image_cached: bool = True
    image_size_mb: float = DEFAULT_IMAGE_SIZE_MB
    pull_bandwidth_mb_s: float = DEFAULT_PULL_BANDWIDTH_MB_S
    container_start_s: float = DEFAULT_CONTAINER_START_S
    init_s: float = DEFAULT_COLD_START_S
    total_s: float | None = None

    def __post_init__(self) -> None:
        _check_non_negative(self, tuple(f.name for f in fields(self) if f.name != "image_cached"))
        if not self.pull_bandwidth_mb_s > 0:
            raise SimulationError(f"pull_bandwidth_mb_s must be > 0, got {self.pull_bandwidth_mb_s!r}")

    @property
    def pull_s(self) -> float:
        """Seconds to pull the image: 0 if cached, else size / bandwidth."""
        return 0.0 if self.image_cached else self.image_size_mb / self.pull_bandwidth_mb_s

    @property
    def stop_s(self) -> float:
        """Seconds the old pod holds its GPUs without training before they are free."""
        if self.total_s is not None:
            return min(self.grace_period_s, self.total_s)
        return self.grace_period_s

    @property
    def start_s(self) -> float:
        """Seconds the new pod holds its GPUs without training: binding, pull, start, initialisation."""
        if self.total_s is not None:
            return self.total_s - self.stop_s
        return self.scheduling_s + self.pull_s + self.container_start_s + self.init_s

    @property
    def cost_s(self) -> float:
        """The whole cost of one re-creation (seconds), waiting for GPUs not included."""
        return self.stop_s + self.start_s


@dataclass(frozen=True)
class RestartOverheads:
    """Seconds of training lost per resize, by mechanism.

    :param inplace_s: an in-place restart by the sidecar (publish -> first step).
    :param recreate_s: if set, the whole cost of a re-creation (overrides ``recreate``'s parts).
    :param recreate: the re-creation model.
    :param inplace_stop_s: of ``inplace_s``, the first part, during which the trainer still holds its
        old GPUs (it checkpoints and exits; its agent acks the new generation after it): default
        the measured stop of the same trainer, 1.9 s, at most ``inplace_s``.
    :raises SimulationError: a negative or non-finite value.
    """

    inplace_s: float = DEFAULT_INPLACE_RESTART_S
    recreate_s: float | None = None
    recreate: RecreateModel = field(default_factory=RecreateModel)
    inplace_stop_s: float = DEFAULT_INPLACE_STOP_S

    def __post_init__(self) -> None:
        _check_non_negative(self, ("inplace_s", "recreate_s", "inplace_stop_s"))
        if self.recreate_s is not None and self.recreate.total_s != self.recreate_s:
            object.__setattr__(self, "recreate", replace(self.recreate, total_s=self.recreate_s))

    def of(self, mechanism: str) -> float:
        """The whole cost of one resize by ``mechanism`` (seconds)."""
        return self.recreate.cost_s if mechanism == "recreate" else self.inplace_s

    def ack_delay_s(self, mechanism: str) -> float:
        """Seconds from an in-place resize's publication to its ack (the old GPUs are held until then):
        ``inplace_stop_s`` (at most ``inplace_s``) in place, 0 for ``"none"`` (a re-creation's
        stop is its model's)."""
        return min(self.inplace_stop_s, self.inplace_s) if mechanism == "inplace" else 0.0

    @classmethod
    def from_benchmark(cls, path: str | Path, recreate: RecreateModel | None = None) -> RestartOverheads:
        """Overheads from a ``benchmarks/resize_overhead.json`` file: in place its
        ``resize_overhead_s``, the re-creation's initialisation its ``cold_start_s``.

        :raises SimulationError: missing file or fields.
        """
        try:
            data = json.loads(Path(path).read_text())
            inplace, cold = float(data["resize_overhead_s"]), float(data["cold_start_s"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimulationError(f"cannot read restart overheads from {str(path)!r}: {exc}") from None
        return cls(inplace, recreate=replace(recreate or RecreateModel(), init_s=cold))

