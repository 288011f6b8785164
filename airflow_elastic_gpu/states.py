"""The words the broker, its API, the sidecar and the UI share: job statuses, event kinds, a target,
the broker's errors.

Nothing here does I/O or imports the broker's database layer, so the sidecar agent (which must run
with only its transport) and the broker use the same definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from airflow_elastic_gpu.scheduling.state import GpuId


class BrokerError(Exception):
    """Base of the broker's errors."""


class InvalidRequest(BrokerError, ValueError):
    """A caller passed a bad value; the message names it. Nothing was changed."""


class NotFound(BrokerError, LookupError):
    """No such job, node or pool."""


class JobStatus(StrEnum):
    """A job's life: QUEUED -> RUNNING (<-> SUSPENDED) -> one of the terminal states."""

    QUEUED = "queued"  # submitted, no GPUs published yet
    RUNNING = "running"  # has a target allocation (generation >= 1)
    SUSPENDED = "suspended"  # a preemptible job resized to zero GPUs: checkpointed, stopped, keeps its place
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"  # its agent stopped heart-beating; GPUs reclaimed

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.LOST})
ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.SUSPENDED)


class EventKind(StrEnum):
    """What a broker event records (the ``kind`` column of the event table and of the API)."""

    NODE = "node"  # a node registered, drained or made schedulable
    CONFIG = "config"  # a pool's policy, lease or rebalance period changed
    SUBMIT = "submit"
    START = "start"  # first generation published (QUEUED -> RUNNING)
    RESIZE = "resize"  # a later generation published with another GPU set
    SUSPEND = "suspend"  # a generation with no GPUs published to a preemptible job (RUNNING -> SUSPENDED)
    RESUME = "resume"  # a generation with GPUs published to a suspended job (SUSPENDED -> RUNNING)
    ACK = "ack"  # the agent runs the trainer on a generation's GPUs
    FINISHING = "finishing"  # one node's trainer of a gang of pods exited cleanly; the others run on
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    RELEASE = "release"  # an ended job's held GPUs freed (a cancelled job's trainer stopped)
    OUTAGE = "outage"  # the pool's rebalances resumed after a gap longer than its lease (the database was away)
    BACKEND = "backend"  # the backend could not do what a job needs now and tries again (a pod not created: a quota)

    @classmethod
    def ended(cls, status: JobStatus) -> EventKind:
        """The event kind that records a job ending with ``status`` (a terminal status)."""
        return cls(status.value)


ENDED_KINDS = frozenset({EventKind.SUCCEEDED, EventKind.FAILED, EventKind.CANCELLED, EventKind.LOST})
"""Event kinds that end a job."""

PUBLISH_KINDS = frozenset({EventKind.START, EventKind.RESIZE, EventKind.SUSPEND, EventKind.RESUME})
"""Event kinds that publish a new generation."""


@dataclass(frozen=True)
class Target:
    """What the agent should run: ``gpus`` in generation ``generation`` (0: none yet).

    :param lease_s: the job's pool's heartbeat lease (seconds): the broker declares the job LOST,
        and hands its GPUs on, after this long without a heartbeat; the sidecar fences its trainer
        well before (see ``docs/fencing.md``). None where unknown.
    """

    job_id: str
    status: JobStatus
    generation: int
    gpus: tuple[GpuId, ...]
    lease_s: float | None = None

    def device_indices(self) -> list[int]:
        return [g.index for g in self.gpus]
