"""SQLAlchemy 2.0 ORM of the broker's state: pools, nodes, GPUs, jobs, allocations, samples, events.

Times are seconds since the epoch (floats) on the broker's injected clock, so
the simulator can drive the broker with a fake one.

The invariant "no GPU is in use by two jobs" is held by the primary key of
``gpu_in_use`` (one row per GPU); ``gpu_target`` has the same key, so a GPU is
also never *published* to two jobs at once.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from airflow_elastic_gpu.states import TERMINAL, JobStatus

__all__ = [
    "TERMINAL",
    "Base",
    "Event",
    "Gpu",
    "GpuInUse",
    "GpuPool",
    "GpuTarget",
    "Job",
    "JobStatus",
    "Node",
    "NodeAck",
    "ProgressSample",
    "RebalanceRequest",
]


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON}


class GpuPool(Base):
    """A named set of nodes shared out by the broker; its row is the pool's lock."""

    __tablename__ = "gpu_pool"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_rebalance_s: Mapped[float] = mapped_column(Float, default=0.0)
    created_s: Mapped[float] = mapped_column(Float)
    # scheduling settings shared by every process that uses the pool
    policy: Mapped[str] = mapped_column(String(64), default="adaptive")
    policy_params: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    lease_s: Mapped[float] = mapped_column(Float, default=60.0)
    rebalance_interval_s: Mapped[float] = mapped_column(Float, default=10.0)
    # the highest rebalance request id the last rebalance served: pending ones are above it
    served_request_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), default=0,
                                                   server_default="0")


class Node(Base):
    __tablename__ = "node"
    __table_args__ = (UniqueConstraint("pool", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(ForeignKey("gpu_pool.name"))
    name: Mapped[str] = mapped_column(String(253))
    schedulable: Mapped[bool] = mapped_column(default=True)
    gpus: Mapped[list[Gpu]] = relationship(back_populates="node", order_by="Gpu.index")


class Gpu(Base):
    __tablename__ = "gpu"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("node.id"))
    index: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str] = mapped_column(String(128))
    healthy: Mapped[bool] = mapped_column(default=True)
    node: Mapped[Node] = relationship(back_populates="gpus")


class Job(Base):
    __tablename__ = "job"
    __table_args__ = (
        Index("ix_job_pool_status", "pool", "status"), Index("ix_job_pool_family_end", "pool", "family", "end_s"),
        # the pool page's latest ended jobs, and /jobs in submit order (migration 0016)
        Index("ix_job_pool_end_id", "pool", "end_s", "id"), Index("ix_job_pool_submit_id", "pool", "submit_s", "id"),
        Index("ix_job_submit_id", "submit_s", "id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    key: Mapped[str] = mapped_column(String(512), unique=True)
    pool: Mapped[str] = mapped_column(ForeignKey("gpu_pool.name"))
    name: Mapped[str] = mapped_column(String(256))
    # the training it repeats (throughput prior of unmeasured jobs); always set at submit
    family: Mapped[str | None] = mapped_column(String(256), default=None)
    # the Airflow task try that submitted it (JobSpec.attempt), if one did
    attempt: Mapped[str | None] = mapped_column(String(64), default=None)
    # that task's max_tries then (JobSpec.max_tries): Airflow raises it when the task is cleared
    max_tries: Mapped[int | None] = mapped_column(Integer, default=None)
    # and its DAG run's clear_number then (JobSpec.clear_number): raised by every clear of the run
    clear_number: Mapped[int | None] = mapped_column(Integer, default=None)
    command: Mapped[str] = mapped_column(Text)
    min_gpus: Mapped[int] = mapped_column(Integer)
    max_gpus: Mapped[int] = mapped_column(Integer)
    requested_gpus: Mapped[int] = mapped_column(Integer)
    total_steps: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    progress_pattern: Mapped[str | None] = mapped_column(Text, default=None)
    checkpoint_dir: Mapped[str | None] = mapped_column(Text, default=None)
    backend: Mapped[str] = mapped_column(String(32), default="local")
    backend_ref: Mapped[str | None] = mapped_column(Text, default=None)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    exit_code: Mapped[int | None] = mapped_column(Integer, default=None)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    steps_done: Mapped[float] = mapped_column(Float, default=0.0)
    target_generation: Mapped[int] = mapped_column(Integer, default=0)
    acked_generation: Mapped[int] = mapped_column(Integer, default=0)
    num_resizes: Mapped[int] = mapped_column(Integer, default=0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    restart_overhead_s: Mapped[float | None] = mapped_column(Float, default=None)
    throughput: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    submit_s: Mapped[float] = mapped_column(Float)
    start_s: Mapped[float | None] = mapped_column(Float, default=None)
    end_s: Mapped[float | None] = mapped_column(Float, default=None)
    last_heartbeat_s: Mapped[float] = mapped_column(Float)
    last_resize_s: Mapped[float | None] = mapped_column(Float, default=None)
    published_s: Mapped[float | None] = mapped_column(Float, default=None)
    in_use_since_s: Mapped[float | None] = mapped_column(Float, default=None)
    # sha256 of the job's API bearer token (the token itself is never stored)
    token_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    last_start_s: Mapped[float | None] = mapped_column(Float, default=None)
    suspensions: Mapped[list[float] | None] = mapped_column(JSON, default=None)
    # a gang of pods: the nodes whose trainer exited with 0 without the final metrics line, while
    # the job runs on (it succeeds once every node of its generation has, or the metrics come)
    finished_nodes: Mapped[list[str] | None] = mapped_column(JSON, default=None)


class GpuTarget(Base):
    """The GPUs published to a job in its latest generation (one row per GPU)."""

    __tablename__ = "gpu_target"

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpu.id"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id"), index=True)
    generation: Mapped[int] = mapped_column(Integer)


class GpuInUse(Base):
    """The GPUs a job's trainer runs on (moved here by an ack). One row per GPU: never two jobs."""

    __tablename__ = "gpu_in_use"

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpu.id"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id"), index=True)
    generation: Mapped[int] = mapped_column(Integer)


class NodeAck(Base):
    """One node of a job that runs one agent per node (a gang on Kubernetes) runs ``generation``.

    One row per (job, node), replaced by a newer generation's ack; the job's in-use set moves to
    its target only once every node of the target and of the in-use set has a row of the target's
    generation (then the job's rows are deleted). See ``Lifecycle.ack``.
    """

    __tablename__ = "node_ack"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.id"), primary_key=True)
    node: Mapped[str] = mapped_column(String(253), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer)


class RebalanceRequest(Base):
    """A change that may move allocations (submit, ack, a job's end, ...) asks its pool for a rebalance.

    Insert-only for the callers, so they never wait on a running rebalance; the next rebalance
    deletes the requests it serves (see :mod:`airflow_elastic_gpu.broker.rebalance`).
    """

    __tablename__ = "rebalance_request"
    # ids only grow (SQLite: AUTOINCREMENT), so that pending requests are those above the watermark
    __table_args__ = (Index("ix_rebalance_request_pool_id", "pool", "id"), {"sqlite_autoincrement": True})

    # 64-bit: every allocation-changing call inserts one (2^31 of them are weeks at full load);
    # SQLite's rowid is 64-bit already, and AUTOINCREMENT needs the INTEGER type there
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    pool: Mapped[str] = mapped_column(ForeignKey("gpu_pool.name"))
    time_s: Mapped[float] = mapped_column(Float)


class ProgressSample(Base):
    __tablename__ = "progress_sample"

    # 64-bit on PostgreSQL (migration 0009); SQLite's INTEGER PRIMARY KEY is 64-bit already
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id"), index=True)
    time_s: Mapped[float] = mapped_column(Float)
    step: Mapped[float] = mapped_column(Float)
    num_gpus: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer)


class Event(Base):
    """Something the broker did or saw, with its reason (resizes carry predicted gain and overhead)."""

    __tablename__ = "event"
    __table_args__ = (Index("ix_event_pool_id", "pool", "id"),)  # a pool's latest events (migration 0016)

    # 64-bit on PostgreSQL (migration 0009); SQLite's INTEGER PRIMARY KEY is 64-bit already
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    time_s: Mapped[float] = mapped_column(Float, index=True)
    pool: Mapped[str] = mapped_column(String(128))
    job_id: Mapped[str | None] = mapped_column(String(36), index=True, default=None)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
