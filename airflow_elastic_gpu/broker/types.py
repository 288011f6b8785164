"""Values the broker takes and returns (frozen dataclasses) and its errors."""

from __future__ import annotations

import hashlib
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.states import BrokerError, InvalidRequest, JobStatus, NotFound, Target

__all__ = [
    "BACKENDS", "DEFAULT_POOL", "BrokerError", "EventView", "GpuView", "InvalidRequest", "JobSpec", "JobStatus",
    "JobView", "NodeView", "NotFound", "PoolSnapshot", "Target", "check_int", "check_pool_name", "check_text",
    "compile_progress_pattern",
    "family_of", "task_family",
]

DEFAULT_POOL = "default"
BACKENDS = ("local", "kubernetes", "simulated")
"""Where a job's processes run; ``simulated``: none (the simulator's broker mode)."""
MAX_INT32 = 2**31 - 1
"""Largest count, step or priority the database stores (a 32-bit integer column)."""
MAX_NAME_CHARS = 256
MAX_KEY_CHARS = 512
MAX_POOL_CHARS = 128
MAX_GPU_TYPES = 64
"""Most GPU types a job's ``relative_speed`` hint may name."""
MAX_SPEED_RATIO = 1000.0
"""Most a job's ``relative_speed`` hint may set its fastest GPU type apart from its slowest (GPU
generations differ by 2-50x; a ratio of 1e600 made the per-type models infinite)."""
MAX_GPU_TYPE_CHARS = 128
_MAP_INDEX = re.compile(r"\[\d+\]$")


def family_of(name: str) -> str:
    """The default family of a job named ``name``: the name without a trailing map index
    (``"train[3]"`` -> ``"train"``), so the instances of one mapped task share a family."""
    return _MAP_INDEX.sub("", name) or name


def task_family(dag_id: str, task_id: str) -> str:
    """The family of an Airflow task's jobs: ``dag_id.task_id`` (every run and every map index of the
    task trains the same model), cut to the 256 characters a family may have."""
    return f"{dag_id}.{task_id}"[:MAX_NAME_CHARS]


def task_key(dag_id: str, task_id: str, run_id: str, map_index: int, deployment: str = "") -> str:
    """The job key of an Airflow task instance (``JobSpec.key``, one job per task instance):
    ``dag_id/task_id/run_id/map_index``, after ``deployment/`` where the Airflow deployment has a
    name (``[elastic_gpu] deployment``: deployments sharing a broker). Ids of Airflow's longest (250
    characters each) would pass :data:`MAX_KEY_CHARS`, or leave no room for the ``@<job id>`` of a
    replaced job's record: such a key is cut and ends with a hash of the whole (``#`` and 16 hex
    digits)."""
    key = f"{deployment + '/' if deployment else ''}{dag_id}/{task_id}/{run_id}/{int(map_index)}"
    room = MAX_KEY_CHARS - 37  # "@" and a job id (a uuid, 36 characters)
    if len(key) <= room:
        return key
    return f"{key[:room - 17]}#{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def task_key_parts(key: str, family: str | None) -> tuple[str, str, str, str, str] | None:
    """The inverse of :func:`task_key`: ``(deployment, dag_id, task_id, run_id, map_index)`` of a
    job's ``key`` and ``family`` as the operator submits them (the family ``dag_id.task_id``), the
    deployment ``""`` for none and the map index as written; None for any other key (a job
    submitted otherwise, or a key cut for length: it ends in a hash). Airflow's ids hold no ``/``
    (DAG and task ids by their rule, run ids by the default ``allowed_run_id_pattern``)."""
    parts = key.split("/")
    if len(parts) not in (4, 5) or "#" in key or (len(parts) == 5 and not parts[0]):
        return None
    deployment = parts[0] if len(parts) == 5 else ""
    dag_id, task_id, run_id, map_index = parts[-4:]
    if family is None or family != task_family(dag_id, task_id):
        return None
    return deployment, dag_id, task_id, run_id, map_index


def check_text(name: str, value: Any, max_chars: int, *, empty_ok: bool = False) -> None:
    """Raise :class:`InvalidRequest` unless ``value`` is a string of at most ``max_chars`` characters,
    without NUL characters, and (unless ``empty_ok``) not blank."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__} {value!r}")
    if not empty_ok and not value.strip():
        raise InvalidRequest(f"{name} must not be empty")
    if len(value) > max_chars:
        raise InvalidRequest(f"{name} must be at most {max_chars} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidRequest(f"{name} must not contain NUL characters")


def check_pool_name(name: str, value: Any) -> None:
    """Raise :class:`InvalidRequest` unless ``value`` is a GPU pool name: :func:`check_text` of at most
    :data:`MAX_POOL_CHARS` characters, no ``/`` (the API's and the page's URLs carry the name as one
    path segment) and no space at either end (``"a "`` would be another pool than ``"a"``)."""
    check_text(name, value, MAX_POOL_CHARS)
    if "/" in value:
        raise InvalidRequest(f"{name} must not contain '/', got {value!r}")
    if value != value.strip():
        raise InvalidRequest(f"{name} must not start or end with a space, got {value!r}")


def check_int(name: str, value: Any, low: int, high: int = MAX_INT32) -> None:
    """Raise :class:`InvalidRequest` unless ``value`` is an integer (not a bool) in ``[low, high]``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidRequest(f"{name} must be an integer >= {low}, got {value!r}")
    if value > high:
        raise InvalidRequest(f"{name} must be at most {high}, got {value}")


@dataclass(frozen=True)
class JobSpec:
    """What a caller submits; validated when built (the one validation of a job's fields, used at
    DAG parse time by the operator, by the CLI and by the broker).

    :param name: display name (e.g. ``dag.task``), at most 256 characters.
    :param command: the training command (a shell-style string that :func:`shlex.split` splits into at
        least one word, ``{num_gpus}`` expanded at launch).
    :param min_gpus: fewest GPUs it runs on (>= 1).
    :param max_gpus: most GPUs it can use (>= ``min_gpus``); default ``min_gpus`` (not elastic).
    :param total_steps: steps in the whole training (>= 1), to predict remaining time.
    :param requested_gpus: fixed request for non-elastic policies, in ``[min_gpus, max_gpus]``;
        default ``max_gpus``. The adaptive policy spreads a job not yet measured on a whole node
        over no more nodes than this needs.
    :param key: idempotency key (1-512 characters); submitting the same key again returns the same
        job while it is unfinished. Default: a fresh UUID.
    :param pool: GPU pool name (1-128 characters).
    :param priority: larger is served first (a 32-bit integer).
    :param progress_pattern: regex with a ``step`` group (or one group) parsed from the log;
        default: JSON lines with a ``"step"`` key.
    :param checkpoint_dir: where the trainer checkpoints, an absolute path (the backend checks that it
        can be written).
    :param backend: one of :data:`BACKENDS`.
    :param preemptible: the job may be suspended (resized to zero GPUs: checkpoint, stop, keep its
        place) when its pool allows suspension, and resumed from its checkpoint later. Off by default.
    :param relative_speed: optional hint for pools of several GPU types: GPU type (as the nodes
        report it, e.g. ``"NVIDIA A100"``) -> the job's relative single-GPU speed there (a finite
        number > 0, any unit: only ratios count, at most 1,000 between two types; e.g. samples/s from a profile). The type-aware
        policy uses it for the types the job has not run on yet; at most 64 types.
    :param family: the training this job repeats, at most 256 characters: until the job is
        measured, the broker assumes it runs as fast as the other jobs of its family (the running
        ones, else the latest finished one). The operator sets ``dag_id.task_id``; default: the name
        without a trailing map index (:func:`family_of`).
    :param attempt: the Airflow task try that submits it (the task instance's id, new for every
        try), at most 64 characters: when the job of ``key`` has ended, the same attempt submitting
        the key again gets that job back (a trigger made again after a triggerer restart: its job
        ended meanwhile and must not train again), any other attempt a new job (a retry), unless:
    :param max_tries: the Airflow task's ``max_tries`` (>= 0) when it submits: Airflow raises it
        when a user clears the task, never on a retry. A retry (another ``attempt``, the same
        ``max_tries``) of a task whose job of ``key`` succeeded gets that job back (the try failed
        after the training: its worker lost while it returned the result), rather than training
        again for hours; a cleared task trains again.
    :param clear_number: the Airflow DAG run's ``clear_number`` (>= 0) when it submits: Airflow
        adds one each time a user clears tasks of the run, never on a retry. With it, a retry is
        told from a clear even when the clear left ``max_tries`` as it was (the task's ``retries``
        lowered before the clear, or a task cleared while it still ran: ``max_tries`` then stays):
        the succeeded job is given back only when both match.
    :raises InvalidRequest: a bad field; the message names it.
    """

    name: str
    command: str
    min_gpus: int = 1
    max_gpus: int | None = None
    total_steps: int = 1
    requested_gpus: int | None = None
    key: str | None = None
    pool: str = DEFAULT_POOL
    priority: int = 0
    progress_pattern: str | None = None
    checkpoint_dir: str | None = None
    backend: str = "local"
    preemptible: bool = False
    relative_speed: Mapping[str, float] | None = None
    family: str | None = None
    attempt: str | None = None
    max_tries: int | None = None
    clear_number: int | None = None

    def __post_init__(self) -> None:
        check_text("name", self.name, MAX_NAME_CHARS)
        if self.family is None:
            object.__setattr__(self, "family", family_of(self.name))
        check_text("family", self.family, MAX_NAME_CHARS)
        check_text("command", self.command, 64 * 1024)
        try:  # as every launcher splits it: a command no retry can start is refused before it is queued
            argv = shlex.split(self.command)
        except ValueError as exc:
            raise InvalidRequest(f"command {self.command!r} does not parse (as a shell would split it): {exc}") from None
        if not argv:
            raise InvalidRequest("command must not be empty")
        check_int("min_gpus", self.min_gpus, 1)
        if self.max_gpus is None:
            object.__setattr__(self, "max_gpus", self.min_gpus)
        check_int("max_gpus", self.max_gpus, 1)
        check_int("total_steps", self.total_steps, 1)
        if self.min_gpus > self.max_gpus:
            raise InvalidRequest(
                f"min_gpus ({self.min_gpus}) must not be larger than max_gpus ({self.max_gpus})"
            )
        if self.requested_gpus is not None:
            check_int("requested_gpus", self.requested_gpus, 1)
            if not self.min_gpus <= self.requested_gpus <= self.max_gpus:
                raise InvalidRequest(
                    f"requested_gpus ({self.requested_gpus}) must lie between min_gpus "
                    f"({self.min_gpus}) and max_gpus ({self.max_gpus})"
                )
        if self.key is not None:
            check_text("key", self.key, MAX_KEY_CHARS)
        if self.attempt is not None:
            check_text("attempt", self.attempt, 64)
        if self.max_tries is not None:
            check_int("max_tries", self.max_tries, 0, MAX_INT32)
        if self.clear_number is not None:
            check_int("clear_number", self.clear_number, 0, MAX_INT32)
        check_pool_name("pool", self.pool)
        check_int("priority", self.priority, -MAX_INT32, MAX_INT32)
        if self.checkpoint_dir is not None:
            check_text("checkpoint_dir", self.checkpoint_dir, 4096)
            if not self.checkpoint_dir.startswith("/"):  # "~" too: resolved by whom, where?
                raise InvalidRequest(f"checkpoint_dir {self.checkpoint_dir!r} must be an absolute path: each process of "
                                     "the job (worker, triggerer, launcher, container) would resolve a relative one "
                                     "from its own directory")
        if self.backend not in BACKENDS:
            raise InvalidRequest(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.progress_pattern is not None:
            check_text("progress_pattern", self.progress_pattern, 4096)
        compile_progress_pattern(self.progress_pattern)
        if not isinstance(self.preemptible, bool):
            raise InvalidRequest(f"preemptible must be True or False, got {self.preemptible!r}")
        if self.relative_speed is not None:
            object.__setattr__(self, "relative_speed", check_relative_speed(self.relative_speed))


def check_relative_speed(value: Any) -> dict[str, float]:
    """``value`` as a ``{gpu_type: speed}`` dict, or raise :class:`InvalidRequest` saying what is wrong
    (not a mapping, more than :data:`MAX_GPU_TYPES` entries, a bad type name, a speed that is not a
    finite number > 0, speeds further apart than :data:`MAX_SPEED_RATIO`)."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"relative_speed must be a mapping of GPU type to speed, got {type(value).__name__}")
    if len(value) > MAX_GPU_TYPES:
        raise InvalidRequest(f"relative_speed may name at most {MAX_GPU_TYPES} GPU types, got {len(value)}")
    out = {}
    for gpu_type, speed in value.items():
        check_text("relative_speed GPU type", gpu_type, MAX_GPU_TYPE_CHARS)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (math.isfinite(speed) and speed > 0):
            raise InvalidRequest(f"relative_speed[{gpu_type!r}] must be a finite number > 0, got {speed!r}")
        out[gpu_type] = float(speed)
    if out and max(out.values()) > MAX_SPEED_RATIO * min(out.values()):  # scaled by it, a model overflowed
        raise InvalidRequest(f"relative_speed: the fastest type may be at most {MAX_SPEED_RATIO:g} times the "
                             f"slowest, got {max(out.values()) / min(out.values()):g}")
    return out


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
    preemptible: bool = False
    family: str | None = None  # the training it repeats (see JobSpec.family)
    attempt: str | None = None  # the task try it belongs to (see JobSpec.attempt and GpuBroker.cancel)
    published_s: float | None = None  # when its current target generation was published
    token: str | None = None  # the job's API bearer token: only in the reply that created it

    def acked(self, generation: int | None = None) -> bool:
        """Whether the job's agent has acked ``generation`` (default: its target's), a published one
        (>= 1), or a later one: its trainer runs on that generation's GPUs (a backend that finds
        no pod then finds one deleted from outside, not one still to make)."""
        return self.acked_generation >= max(1, self.target_generation if generation is None else generation)

    @property
    def suspended(self) -> bool:
        """True while the job is suspended (resized to zero GPUs; it resumes from its checkpoint)."""
        return self.status is JobStatus.SUSPENDED

    @property
    def jct_s(self) -> float | None:
        """Job completion time: finish - submit (queueing included), ``None`` while unfinished."""
        return None if self.end_s is None else self.end_s - self.submit_s

    @property
    def queueing_delay_s(self) -> float | None:
        return None if self.start_s is None else self.start_s - self.submit_s

    def progress_warning(self) -> str | None:
        """A warning for a job that succeeded without a step the broker could read from its log (its
        progress pattern never matched: the broker could neither measure its speed nor resize it
        on that), else ``None``."""
        if self.status is not JobStatus.SUCCEEDED or self.steps_done > 0:
            return None
        which = (f"--progress-pattern / progress_pattern {self.progress_pattern!r}" if self.progress_pattern
                 else 'the default: a JSON line with "step"')
        return (f"job {self.id} reported no step of its {self.total_steps:,}: no line of its log matched the "
                f"progress pattern ({which}), so the broker could not measure its throughput")


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
class PoolConfig:
    """A GPU pool's settings (``airflow-elastic-gpu pool``).

    :param policy: the policy's name (:func:`~airflow_elastic_gpu.scheduling.policy.get_policy`).
    :param policy_params: the parameters set for it (those not set are absent: its defaults apply).
    :param lease_s: seconds without a heartbeat after which a running job is declared lost.
    :param rebalance_interval_s: the longest time between two rebalances (seconds).
    """

    policy: str
    policy_params: dict[str, Any]
    lease_s: float
    rebalance_interval_s: float


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything a UI shows of one pool at one moment."""

    pool: str
    time_s: float
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]
    events: tuple[EventView, ...] = field(default=())
    ended_hidden: int = 0  # ended jobs of the pool not in ``jobs`` (older than the ones shown)


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
