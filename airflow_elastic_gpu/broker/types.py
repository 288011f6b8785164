"""Values the broker takes and returns (frozen dataclasses) and its errors."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.scheduling.state import GpuId

DEFAULT_POOL = "default"


class BrokerError(Exception):
    """Base of the broker's errors."""


class InvalidRequest(BrokerError, ValueError):
    """A caller passed a bad value; the message names it. Nothing was changed."""


class NotFound(BrokerError, LookupError):
    """No such job, node or pool."""


class StaleGeneration(BrokerError):
    """An ack or report names a generation that is no longer the job's target."""


@dataclass(frozen=True)
class JobSpec:
    """What a caller submits.

    :param name: display name (e.g. ``dag.task``).
    :param command: the training command (a shell-style string, ``{num_gpus}`` expanded at launch).
    :param min_gpus: fewest GPUs it runs on (>= 1).
    :param max_gpus: most GPUs it can use (>= ``min_gpus``).
    :param total_steps: steps in the whole training (>= 1), to predict remaining time.
    :param requested_gpus: fixed request for non-elastic policies; default ``max_gpus``.
    :param key: idempotency key; submitting the same key again returns the same job
        while it is unfinished. Default: a fresh UUID.
    :param pool: GPU pool name.
    :param priority: larger is served first.
    :param progress_pattern: regex with a ``step`` group (or one group) parsed from the log;
        default: JSON lines with a ``"step"`` key.
    :param checkpoint_dir: where the trainer checkpoints (the backend checks it).
    :param backend: ``"local"`` or ``"kubernetes"``.
    """

    name: str
    command: str
    min_gpus: int = 1
    max_gpus: int = 1
    total_steps: int = 1
    requested_gpus: int | None = None
    key: str | None = None
    pool: str = DEFAULT_POOL
    priority: int = 0
    progress_pattern: str | None = None
    checkpoint_dir: str | None = None
    backend: str = "local"


@dataclass(frozen=True)
class JobView:
    """A read-only copy of a job's record (times in epoch seconds)."""

    id: str
    key: str
    name: str
    pool: str
    command: str
    status: JobStatus
    min_gpus: int
    max_gpus: int
    requested_gpus: int
    total_steps: int
    priority: int
    steps_done: float
    target_generation: int
    acked_generation: int
    target_gpus: tuple[GpuId, ...]
    in_use_gpus: tuple[GpuId, ...]
    num_resizes: int
    gpu_seconds: float
    restart_overhead_s: float | None
    throughput: tuple[tuple[int, float], ...]
    submit_s: float
    start_s: float | None
    end_s: float | None
    last_heartbeat_s: float
    exit_code: int | None
    reason: str | None
    metrics: dict[str, Any] | None
    progress_pattern: str | None
    checkpoint_dir: str | None
    backend: str
    backend_ref: str | None
    token: str | None = None  # the job's API bearer token: only in the reply that created it

    @property
    def jct_s(self) -> float | None:
        """Job completion time: finish - submit (queueing included), ``None`` while unfinished."""
        return None if self.end_s is None else self.end_s - self.submit_s

    @property
    def queueing_delay_s(self) -> float | None:
        return None if self.start_s is None else self.start_s - self.submit_s


@dataclass(frozen=True)
class Target:
    """What the agent should run: ``gpus`` in generation ``generation`` (0: none yet)."""

    job_id: str
    status: JobStatus
    generation: int
    gpus: tuple[GpuId, ...]

    def device_indices(self) -> list[int]:
        return [g.index for g in self.gpus]


@dataclass(frozen=True)
class GpuView:
    gpu: GpuId
    gpu_type: str
    healthy: bool
    in_use_by: str | None
    target_of: str | None


@dataclass(frozen=True)
class NodeView:
    pool: str
    name: str
    schedulable: bool
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True)
class EventView:
    id: int
    time_s: float
    pool: str
    job_id: str | None
    kind: str
    message: str
    data: dict[str, Any] | None


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything a UI shows of one pool at one moment."""

    pool: str
    time_s: float
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]
    events: tuple[EventView, ...] = field(default=())


def compile_progress_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """Compile a progress regex; it must have a ``step`` group or exactly one group.

    :raises InvalidRequest: the regex does not compile or has no usable group.
    """
    if pattern is None:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InvalidRequest(f"progress_pattern {pattern!r} is not a valid regex: {exc}") from None
    if "step" not in compiled.groupindex and compiled.groups != 1:
        raise InvalidRequest(
            f"progress_pattern {pattern!r} must have a named group (?P<step>...) "
            f"or exactly one group; it has {compiled.groups}"
        )
    return compiled
