"""The broker's HTTP API (FastAPI): sidecar endpoints with per-job bearer tokens, and read-only JSON and
a live page for UIs.

Two parts:

* ``/api/v1/jobs/{job_id}/...`` (heartbeat, progress, target, ack, finish, fail): what a job's agent
  calls. Each request carries the job's bearer token (created at submit, only its hash is stored);
  a token for one job can never read or change another. No token: 401; a token that is not this
  job's: 403.
* ``/api/v1/pools/...``, ``/api/v1/jobs``, ``/api/v1/events`` and ``/ui``: read-only views for people
  (pool snapshot with who holds which GPU, jobs with progress and throughput, allocation timeline,
  the event log with each resize's reason). Inside Airflow's api-server (the plugin) they require
  Airflow's own authentication; stand-alone (``airflow-elastic-gpu broker serve``) they are open, or
  need ``AIRFLOW_ELASTIC_GPU_UI_TOKEN`` as a bearer token when that is set.

The page's charts use plotly.js, served from the ``plotly`` package on this server (no external
network at view time).
"""



import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    EventView,
    InvalidRequest,
    JobView,
    NotFound,
    PoolSnapshot,
    Target,
)

API_PREFIX = "/api/v1"
MAX_INT = 2**31 - 1  # ids and generations are 32-bit integers in PostgreSQL
STATIC = Path(__file__).with_name("static")
bearer = HTTPBearer(auto_error=False)


# --------------------------------------------------------------------------- models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProgressIn(_Strict):
    step: float = Field(ge=0, allow_inf_nan=False, description="steps done so far")
    generation: int | None = Field(default=None, ge=1, le=MAX_INT, description="the generation that made them")
    time_s: float | None = Field(default=None, allow_inf_nan=False, description="epoch seconds (default: now)")


class AckIn(_Strict):
    generation: int = Field(ge=1, le=MAX_INT, description="the generation now running")


class FinishIn(_Strict):
    exit_code: int = Field(default=0, ge=0, le=255)
    metrics: dict[str, Any] | None = None


class FailIn(_Strict):
    reason: str = Field(min_length=1, max_length=20_000, description="why the job cannot go on")
    exit_code: int | None = Field(default=None, ge=-255, le=255)
    metrics: dict[str, Any] | None = None


class TargetOut(BaseModel):
    job_id: str
    status: str
    generation: int
    gpus: list[str] = Field(description="node:index of each GPU of the generation")


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
    throughput: list[tuple[int, float]] = Field(description="(GPUs, steps/s) measured on each count")
    submit_s: float
    start_s: float | None
    end_s: float | None
    jct_s: float | None
    queueing_delay_s: float | None
    exit_code: int | None
    reason: str | None
    metrics: dict[str, Any] | None


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
    jobs: list[JobOut]
    events: list[EventOut]


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
        throughput=[(int(n), float(t)) for n, t in j.throughput], submit_s=j.submit_s, start_s=j.start_s,
        end_s=j.end_s, jct_s=j.jct_s, queueing_delay_s=j.queueing_delay_s, exit_code=j.exit_code,
        reason=j.reason, metrics=j.metrics,
    )


def event_out(e: EventView) -> EventOut:
    return EventOut(id=e.id, time_s=e.time_s, pool=e.pool, job_id=e.job_id, kind=e.kind, message=e.message,
                    data=e.data)


def target_out(t: Target) -> TargetOut:
    return TargetOut(job_id=t.job_id, status=t.status.value, generation=t.generation, gpus=[str(g) for g in t.gpus])


def snapshot_out(s: PoolSnapshot) -> SnapshotOut:
    return SnapshotOut(
        pool=s.pool, time_s=s.time_s,
        nodes=[NodeOut(name=n.name, schedulable=n.schedulable, gpus=[
            GpuOut(gpu=str(g.gpu), gpu_type=g.gpu_type, healthy=g.healthy, in_use_by=g.in_use_by,
                   target_of=g.target_of) for g in n.gpus]) for n in s.nodes],
        jobs=[job_out(j) for j in s.jobs], events=[event_out(e) for e in s.events],
    )


def timeline(broker: GpuBroker, pool: str) -> TimelineOut:
    """Each job's GPU count over time, from the broker's ack (running) and end events."""
    jobs = {j.id: j for j in broker.jobs(pool)}
    open_: dict[str, Segment] = {}
    segments: list[Segment] = []
    resizes: list[EventOut] = []
    for e in broker.events(pool, limit=100_000):
        if e.job_id is None or e.job_id not in jobs:
            continue
        if e.kind == "resize":
            resizes.append(event_out(e))
        if e.kind in ("ack", "succeeded", "failed", "cancelled", "lost"):
            seg = open_.pop(e.job_id, None)
            if seg is not None:
                seg.end_s = e.time_s
                segments.append(seg)
        if e.kind == "ack" and e.data and e.data.get("num_gpus"):
            open_[e.job_id] = Segment(job_id=e.job_id, name=jobs[e.job_id].name, start_s=e.time_s, end_s=None,
                                      num_gpus=int(e.data["num_gpus"]), generation=int(e.data.get("generation", 0)))
    segments.extend(open_.values())
    return TimelineOut(pool=pool, time_s=broker.clock(), segments=segments, resizes=resizes)


# --------------------------------------------------------------------------- app


def create_app(
    broker: GpuBroker | None = None,
    *,
    broker_url: str | None = None,
    url_factory: Callable[[], str] | None = None,
    ui_dependencies: list[Callable[..., Any]] | None = None,
    root_path: str = "",
) -> FastAPI:
    """The API as a FastAPI app.

    :param broker: the broker to serve (default: one on ``broker_url`` or the default URL).
    :param ui_dependencies: FastAPI dependencies guarding the read-only part (Airflow's auth in the
        plugin); default: an optional static bearer token from ``AIRFLOW_ELASTIC_GPU_UI_TOKEN``.
    :param url_factory: gives the broker URL at the first request (the plugin: from the Airflow
        connection, which cannot be read when the plugin is imported).
    :param root_path: where the app is mounted (the page builds its URLs from it).
    """
    made: list[GpuBroker] = [broker] if broker is not None else []

    def get_broker() -> GpuBroker:
        if not made:  # created on first use: importing the app must not touch a database
            made.append(GpuBroker(url_factory() if url_factory else broker_url, migrate=True))
        return made[0]

    BrokerDep = Annotated[GpuBroker, Depends(get_broker)]

    def job_auth(job_id: str, b: BrokerDep,
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token: send the job's API token",
                                headers={"WWW-Authenticate": "Bearer"})
        if not b.verify_token(job_id, credentials.credentials):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"the token is not valid for job {job_id!r}")
        return job_id

    JobAuth = Annotated[str, Depends(job_auth)]

    def ui_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
                 request: Request) -> None:
        expected = os.environ.get("AIRFLOW_ELASTIC_GPU_UI_TOKEN")
        if not expected:
            return
        given = credentials.credentials if credentials else request.query_params.get("token", "")
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this view needs the UI token",
                                headers={"WWW-Authenticate": "Bearer"})

    guards = [Depends(d) for d in (ui_dependencies if ui_dependencies is not None else [ui_token])]

    app = FastAPI(
        title="airflow-elastic-gpu broker API",
        version="1",
        description=__doc__,
        root_path=root_path,
    )

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request: Request, exc: InvalidRequest):
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=422, content={"detail": str(exc)})

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound):
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=404, content={"detail": str(exc)})

    sidecar = APIRouter(prefix=f"{API_PREFIX}/jobs/{{job_id}}", tags=["sidecar"])

    @sidecar.post("/heartbeat", response_model=TargetOut, summary="agent liveness; returns the target")
    def heartbeat(job_id: JobAuth, b: BrokerDep) -> TargetOut:
        return target_out(b.heartbeat(job_id))

    @sidecar.get("/target", response_model=TargetOut, summary="the latest published generation")
    def target(job_id: JobAuth, b: BrokerDep) -> TargetOut:
        return target_out(b.target(job_id))

    @sidecar.post("/progress", status_code=204, summary="the trainer reached a step")
    def progress(job_id: JobAuth, body: ProgressIn, b: BrokerDep) -> None:
        b.progress(job_id, body.step, generation=body.generation, time_s=body.time_s)

    @sidecar.post("/ack", response_model=AckOut, summary="the trainer runs on this generation's GPUs")
    def ack(job_id: JobAuth, body: AckIn, b: BrokerDep) -> AckOut:
        return AckOut(accepted=b.ack(job_id, body.generation))

    @sidecar.post("/finish", response_model=JobOut, summary="the trainer exited with 0")
    def finish(job_id: JobAuth, body: FinishIn, b: BrokerDep) -> JobOut:
        return job_out(b.finish(job_id, body.exit_code, body.metrics))

    @sidecar.post("/fail", response_model=JobOut, summary="the job cannot go on")
    def fail(job_id: JobAuth, body: FailIn, b: BrokerDep) -> JobOut:
        return job_out(b.fail(job_id, body.reason, body.exit_code, body.metrics))

    ui = APIRouter(prefix=API_PREFIX, tags=["ui"], dependencies=guards)

    @ui.get("/pools", response_model=list[str])
    def pools(b: BrokerDep) -> list[str]:
        return b.pools()

    @ui.get("/pools/{pool}/snapshot", response_model=SnapshotOut)
    def snapshot(pool: str, b: BrokerDep, events: Annotated[int, Query(ge=0, le=10_000)] = 50) -> SnapshotOut:
        if pool not in b.pools():
            raise NotFound(f"unknown GPU pool {pool!r}")
        return snapshot_out(b.snapshot(pool, events=events))

    @ui.get("/pools/{pool}/timeline", response_model=TimelineOut)
    def pool_timeline(pool: str, b: BrokerDep) -> TimelineOut:
        if pool not in b.pools():
            raise NotFound(f"unknown GPU pool {pool!r}")
        return timeline(b, pool)

    @ui.get("/jobs", response_model=list[JobOut])
    def jobs(b: BrokerDep, pool: str | None = None, active: bool = False) -> list[JobOut]:
        return [job_out(j) for j in b.jobs(pool, active_only=active)]

    @ui.get("/jobs/{job_id}", response_model=JobOut)
    def job(job_id: str, b: BrokerDep) -> JobOut:
        return job_out(b.job(job_id))

    @ui.get("/events", response_model=list[EventOut])
    def events(b: BrokerDep, pool: str | None = None, job_id: str | None = None,
               after_id: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[EventOut]:
        return [event_out(e) for e in b.events(pool, job_id=job_id, after_id=after_id, limit=limit)]

    page = APIRouter(dependencies=guards, include_in_schema=False)

    @page.get("/ui", response_class=HTMLResponse)
    def ui_page(pool: str = DEFAULT_POOL) -> HTMLResponse:
        return HTMLResponse((STATIC / "pool.html").read_text())

    @page.get("/ui/plotly.min.js")
    def plotly_js() -> FileResponse:
        import plotly

        return FileResponse(Path(plotly.__file__).parent / "package_data" / "plotly.min.js",
                            media_type="application/javascript")

    app.include_router(sidecar)
    app.include_router(ui)
    app.include_router(page)
    return app
