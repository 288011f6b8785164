"""The broker API's request and response models (pydantic), and the conversions from the broker's views.

The models are the API's contract: the OpenAPI schema is generated from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from airflow_elastic_gpu.broker.history import applied_resizes
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import EventView, JobView, PoolSnapshot, Target

MAX_INT = 2**31 - 1  # generations are 32-bit integers in PostgreSQL
MAX_ID = 2**63 - 1  # event ids are 64-bit (migration 0009)
MAX_STEP = 2**53  # the largest step a double counts exactly
MAX_METRICS_BYTES = 16 * 1024  # default; the app passes its own limit in the validation context
MAX_METRICS_DEPTH = 32


def check_metrics(metrics: dict[str, Any] | None, max_bytes: int = MAX_METRICS_BYTES) -> dict[str, Any] | None:
    """``metrics`` if every number in it is finite (as a double), it nests at most
    :data:`MAX_METRICS_DEPTH` levels and it is at most ``max_bytes`` as compact UTF-8 JSON.

    :raises ValueError: what was wrong, naming the place (``metrics['loss']``) or the size.
    """
    if metrics is None:
        return None
    stack: list[tuple[Any, str, int]] = [(metrics, "metrics", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_METRICS_DEPTH:
                raise ValueError(f"{where} nests deeper than {MAX_METRICS_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((v, f"{where}[{k!r:.40}]", depth + 1) for k, v in items)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an integer beyond a double's range
                finite = False
            if not finite:
                raise ValueError(f"{where} is not a finite number (as a double): report a finite value or a string")
        elif value is not None and not isinstance(value, (str, bool)):
            raise ValueError(f"{where} is a {type(value).__name__}, not a JSON value")
    size = len(json.dumps(metrics, ensure_ascii=False, separators=(",", ":")).encode())
    if size > max_bytes:
        raise ValueError(f"metrics are {size} bytes as JSON, more than the {max_bytes} allowed: "
                         "report a summary (final loss, accuracy), not a history")
    return metrics


class _Strict(BaseModel):
    # strict: a JSON true is no step, generation or exit code, nor "7" a number (pydantic's lax mode
    # read them as 1 and 7); an integer is still a float's value
    model_config = ConfigDict(extra="forbid", strict=True)


class ProgressIn(_Strict):
    step: float = Field(ge=0, le=MAX_STEP, allow_inf_nan=False, description="steps done so far")
    generation: int | None = Field(default=None, ge=1, le=MAX_INT, description="the generation that made them")
    time_s: float | None = Field(
        default=None, allow_inf_nan=False, json_schema_extra={"deprecated": True},
        description="ignored: the broker times every sample by its own clock when it arrives (a client's "
                    "clock could forge any throughput); accepted, if finite, for older agents",
    )


class AckIn(_Strict):
    generation: int = Field(ge=1, le=MAX_INT, description="the generation now running")
    node: str | None = Field(default=None, min_length=1, max_length=253, description=(
        "a job with one agent per node (a gang of pods): the node whose agent acks; the generation "
        "is acked once every node of its old and new GPUs has acked it. None: the whole job"))


class _Report(_Strict):
    metrics: dict[str, Any] | None = Field(
        default=None, description="the trainer's final metrics: JSON with finite numbers, at most "
                                  f"{MAX_METRICS_DEPTH} levels deep and 16 KiB (the server's limit) as compact JSON")

    @field_validator("metrics")
    @classmethod
    def _metrics_fit(cls, metrics: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return check_metrics(metrics, (info.context or {}).get("max_metrics_bytes", MAX_METRICS_BYTES))


class _EndReport(_Report):
    node: str | None = Field(default=None, min_length=1, max_length=253, description=(
        "a job with one agent per node (a gang of pods): the node whose agent reports, whose trainer "
        "has stopped; only its GPUs are released, the other nodes' when their agents report. None: "
        "the whole job"))


class FinishIn(_EndReport):
    exit_code: int = Field(default=0, ge=0, le=0, description=(
        "0: a finish is a clean exit; a trainer that exited otherwise is reported with fail"))


class FailIn(_EndReport):
    reason: str = Field(min_length=1, max_length=20_000, pattern=r"\S", description="why the job cannot go on")
    exit_code: int | None = Field(default=None, ge=-255, le=255)


class TargetOut(BaseModel):
    job_id: str
    status: str
    generation: int
    gpus: list[str] = Field(description="node:index of each GPU of the generation")
    lease_s: float | None = Field(default=None, description="the pool's heartbeat lease, seconds")


class AckOut(BaseModel):
    accepted: bool = Field(description="False for an older or already acked generation")


class JobOut(BaseModel):
    id: str
    key: str
    name: str
    pool: str
    status: str
    min_gpus: int
    max_gpus: int
    requested_gpus: int
    total_steps: int
    priority: int
    steps_done: float
    target_generation: int
    acked_generation: int
    target_gpus: list[str]
    in_use_gpus: list[str]
    num_resizes: int
    gpu_seconds: float
    restart_overhead_s: float | None
    throughput: list[tuple[int, float]] = Field(
        description="(GPUs, steps/s) measured on each count; finite (a non-finite sample is left out)")
    submit_s: float
    start_s: float | None
    end_s: float | None
    jct_s: float | None
    queueing_delay_s: float | None
    exit_code: int | None
    reason: str | None
    metrics: dict[str, Any] | None
    preemptible: bool = Field(False, description="the job may be suspended (resized to zero GPUs) in a pool "
                                                 "that allows it")
    family: str | None = Field(None, description="the training the job repeats: an unmeasured job is assumed "
                                                 "as fast as the jobs of its family")


class GpuOut(BaseModel):
    gpu: str
    gpu_type: str
    healthy: bool
    in_use_by: str | None
    target_of: str | None


class NodeOut(BaseModel):
    name: str
    schedulable: bool
    gpus: list[GpuOut]


class EventOut(BaseModel):
    id: int
    time_s: float
    pool: str
    job_id: str | None
    kind: str
    message: str
    data: dict[str, Any] | None


class SnapshotOut(BaseModel):
    pool: str
    time_s: float
    nodes: list[NodeOut]
    jobs: list[JobOut] = Field(description="every queued, running or suspended job and the latest ended ones")
    events: list[EventOut]
    ended_hidden: int = Field(0, description="the pool's ended jobs older than those in jobs (see /jobs)")


class Segment(BaseModel):
    job_id: str
    name: str
    start_s: float
    end_s: float | None = Field(description="None while it lasts")
    num_gpus: int
    generation: int


class TimelineOut(BaseModel):
    pool: str
    time_s: float
    segments: list[Segment]
    resizes: list[EventOut]


def job_out(j: JobView) -> JobOut:
    return JobOut(
        id=j.id, key=j.key, name=j.name, pool=j.pool, status=j.status.value, min_gpus=j.min_gpus,
        max_gpus=j.max_gpus, requested_gpus=j.requested_gpus, total_steps=j.total_steps, priority=j.priority,
        steps_done=j.steps_done, target_generation=j.target_generation, acked_generation=j.acked_generation,
        target_gpus=[str(g) for g in j.target_gpus], in_use_gpus=[str(g) for g in j.in_use_gpus],
        num_resizes=j.num_resizes, gpu_seconds=j.gpu_seconds, restart_overhead_s=j.restart_overhead_s,
        throughput=[(int(n), float(t)) for n, t in j.throughput if math.isfinite(t)], submit_s=j.submit_s, start_s=j.start_s,
        end_s=j.end_s, jct_s=j.jct_s, queueing_delay_s=j.queueing_delay_s, exit_code=j.exit_code,
        reason=j.reason, metrics=j.metrics, preemptible=j.preemptible, family=j.family,
    )


def event_out(e: EventView) -> EventOut:
    return EventOut(id=e.id, time_s=e.time_s, pool=e.pool, job_id=e.job_id, kind=e.kind, message=e.message,
                    data=e.data)


def target_out(t: Target) -> TargetOut:
    return TargetOut(job_id=t.job_id, status=t.status.value, generation=t.generation, gpus=[str(g) for g in t.gpus],
                     lease_s=t.lease_s)


def snapshot_out(s: PoolSnapshot) -> SnapshotOut:
    return SnapshotOut(
        pool=s.pool, time_s=s.time_s,
        nodes=[NodeOut(name=n.name, schedulable=n.schedulable, gpus=[
            GpuOut(gpu=str(g.gpu), gpu_type=g.gpu_type, healthy=g.healthy, in_use_by=g.in_use_by,
                   target_of=g.target_of) for g in n.gpus]) for n in s.nodes],
        jobs=[job_out(j) for j in s.jobs], events=[event_out(e) for e in s.events], ended_hidden=s.ended_hidden,
    )


TIMELINE_EVENTS = 20_000
"""The timeline is drawn from at most this many of the pool's newest events (a few hundred jobs)."""


def timeline(broker: GpuBroker, pool: str) -> TimelineOut:
    """Each job's GPU count over time, from the broker's ack (running) and end events, and the resizes
    applied (:func:`~airflow_elastic_gpu.broker.history.applied_resizes`), each at the moment its
    trainer ran on the new GPUs. From the pool's newest :data:`TIMELINE_EVENTS` events; a job that
    runs since before them has its current bar all the same."""
    open_: dict[str, Segment] = {}
    segments: list[Segment] = []
    resizes: list[EventOut] = []
    # the newest events: a pool's whole history would grow without bound, and its oldest events
    # would crowd out the jobs of today; the names of their jobs only
    events = [e for e in broker.events(pool, limit=TIMELINE_EVENTS, latest=True) if e.job_id is not None]
    names = broker.job_names([e.job_id for e in events if e.job_id is not None])
    events = [e for e in events if e.job_id in names]
    for r in applied_resizes(events):  # at the ack, where the new bar starts; with the decision's reason
        shown = r.published or r.ack
        resizes.append(event_out(dataclasses.replace(shown, time_s=r.time_s)))
    for e in events:
        if e.kind in ("ack", "succeeded", "failed", "cancelled", "lost"):
            seg = open_.pop(e.job_id, None)
            if seg is not None:
                seg.end_s = e.time_s
                segments.append(seg)
        if e.kind == "ack" and e.data and e.data.get("num_gpus"):
            open_[e.job_id] = Segment(job_id=e.job_id, name=names[e.job_id], start_s=e.time_s, end_s=None,
                                      num_gpus=int(e.data["num_gpus"]), generation=int(e.data.get("generation", 0)))
    for job in broker.jobs(pool, active_only=True):
        if job.id in open_ or not job.in_use_gpus:
            continue
        # running since before the events read (a long job among many short ones): its bar from its
        # own latest ack (it had none, and vanished from the timeline while it ran)
        acks = [e for e in broker.events(pool, job_id=job.id, limit=200, latest=True)
                if e.kind == "ack" and e.data and e.data.get("num_gpus")]
        if acks:
            open_[job.id] = Segment(job_id=job.id, name=job.name, start_s=acks[-1].time_s, end_s=None,
                                    num_gpus=int(acks[-1].data["num_gpus"]),
                                    generation=int(acks[-1].data.get("generation", 0)))
    segments.extend(open_.values())
    return TimelineOut(pool=pool, time_s=broker.clock(), segments=segments, resizes=resizes)
