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

# no ``from __future__ import annotations``: FastAPI resolves the closures' ``Annotated`` dependencies
# from the live objects
import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from airflow_elastic_gpu.broker.api_models import (
    MAX_INT,
    AckIn,
    AckOut,
    EventOut,
    FailIn,
    FinishIn,
    JobOut,
    ProgressIn,
    SnapshotOut,
    TargetOut,
    TimelineOut,
    event_out,
    job_out,
    snapshot_out,
    target_out,
    timeline,
)
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import DEFAULT_POOL, InvalidRequest, NotFound

API_PREFIX = "/api/v1"
STATIC = Path(__file__).with_name("static")
bearer = HTTPBearer(auto_error=False)


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
