"""The broker's HTTP API (FastAPI): sidecar endpoints with per-job bearer tokens, and read-only JSON and
a live page for UIs.

Two parts:

* ``/api/v1/jobs/{job_id}/...`` (heartbeat, progress, target, ack, finish, fail): what a job's agent
  calls. Each request carries the job's bearer token (created at submit, only its hash is stored);
  a token for one job can never read or change another. No token: 401; a token that is not this
  job's: 403. The token is checked before the request's body is read. Once the job has ended its
  token changes nothing: progress and ack get 403; heartbeat and target still say that it ended
  (so a running agent stops its trainer) and a repeated finish or fail answers the job as it ended
  (a finish of a LOST job, whose agent could not report the clean exit within the lease, succeeds it).
* ``/api/v1/pools/...``, ``/api/v1/jobs``, ``/api/v1/events`` and ``/ui``: read-only views for people
  (pool snapshot with who holds which GPU, jobs with progress and throughput, allocation timeline,
  the event log with each resize's reason). Inside Airflow's api-server (the plugin) they require
  Airflow's own authentication; stand-alone (``airflow-elastic-gpu broker serve``) they need
  ``AIRFLOW_ELASTIC_GPU_UI_TOKEN`` as a bearer token when that is set, and the command refuses to
  listen beyond the loopback interface without it (:func:`check_bind_address`).

Limits (:mod:`.api_guards`): a body above 256 KiB gets 413 before it is read; bodies are strict
JSON (finite numbers only), every malformed one a 422; a report's ``metrics`` at most 16 KiB.
Progress samples are timed by the broker's clock, never the client's.

The page renders every value as text (DOM ``textContent``, never HTML) under a Content-Security-Policy
that allows scripts from this server only; its script and plotly.js are served from here (no
external network at view time). ``/openapi.json`` is the contract; the Swagger and ReDoc pages, which
load their assets from a CDN, are off unless asked for (``api_docs=True``).
"""

# no ``from __future__ import annotations``: FastAPI resolves the closures' ``Annotated`` dependencies
# from the live objects
import hmac
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from airflow_elastic_gpu.broker.api_access import Viewer, reads_all
from airflow_elastic_gpu.broker.api_guards import (
    ApiLimits,
    BodySizeLimit,
    SecurityHeaders,
    no_nul_parameters,
    parse_body,
)
from airflow_elastic_gpu.broker.api_models import (
    MAX_ID,
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
from airflow_elastic_gpu.broker.types import DEFAULT_POOL, InvalidRequest, NotFound, task_key
from airflow_elastic_gpu.config import (
    DEPLOYMENT_PATTERN,
    ENV_UI_TOKEN,
    airflow_conf,
    default_deployment,
    get_option,
)
from airflow_elastic_gpu.sidecar.protocol import JOB_ANSWER_HEADER

TIMELINE_MAX_AGE_S = 30.0
"""A pool's cached timeline is made again after this many seconds even without a new event of it."""

API_PREFIX = "/api/v1"
ABOUT_THE_JOB = {JOB_ANSWER_HEADER: "1"}  # an answer about the resource asked for, not an unknown path
STATIC = Path(__file__).with_name("static")
JOBS_PAGE = 1000  # jobs per answer of ``/api/v1/jobs`` unless ``limit`` asks for another page size
# at most: a job's JSON is about 2 KiB, but up to 36 KiB with the longest reason and metrics (a broker's
# whole history made answers of 100s of MB)
MAX_JOBS_PAGE = 1000
bearer = HTTPBearer(auto_error=False)


# --------------------------------------------------------------------------- app


def check_bind_address(host: str, ui_token: str | None) -> None:
    """Refuse to serve the read-only views without a token beyond this machine.

    :param host: the address the server will listen on.
    :param ui_token: the read-only views' token, if any.
    :raises ValueError: ``host`` is not a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``)
        and there is no UI token.
    """
    if ui_token or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass  # a host name: other machines may reach it
    raise ValueError(
        f"--host {host} would let anyone who reaches it read every job, pool and event: set "
        f"${ENV_UI_TOKEN} or [elastic_gpu] ui_token (the read-only views then need it, as a bearer token or the page's ?token=), "
        "or keep --host 127.0.0.1")


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that reads its JSON body itself (after its token check)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(
    broker: GpuBroker | None = None,
    *,
    broker_url: str | None = None,
    url_factory: Callable[[], str] | None = None,
    ui_dependencies: list[Callable[..., Any]] | None = None,
    ui_token: str | None = None,
    limits: ApiLimits | None = None,
    api_docs: bool = False,
    root_path: str = "",
    deployment: str | None = None,
    ui_viewer: Callable[..., Viewer] | None = None,
) -> FastAPI:
    """The API as a FastAPI app.

    :param broker: the broker to serve (default: one on ``broker_url`` or the default URL).
    :param ui_dependencies: FastAPI dependencies guarding the read-only part (Airflow's auth in the
        plugin); default: the bearer token ``ui_token`` if there is one.
    :param ui_token: the read-only part's bearer token (also accepted as ``?token=``, for the page);
        default ``[elastic_gpu] ui_token`` (``$AIRFLOW_ELASTIC_GPU_UI_TOKEN``); none: the read-only part is open.
    :param limits: request size limits (default :meth:`ApiLimits.from_env`).
    :param api_docs: serve the Swagger (``/docs``) and ReDoc (``/redoc``) pages. Their assets come
        from a CDN, into the browser of whoever opens them; ``/openapi.json`` is always served.
    :param url_factory: gives the broker URL at the first request (the plugin: from the Airflow
        connection, which cannot be read when the plugin is imported).
    :param root_path: where the app is mounted (the page builds its URLs from it).
    :param deployment: the Airflow deployment whose task instances ``/jobs/by-task`` finds when the
        request names none; default ``[elastic_gpu] deployment``, read at each such request (a bad
        name fails those requests, not the app).
    :param ui_viewer: a FastAPI dependency giving the :class:`~.api_access.Viewer` of a request to
        the read-only part (the plugin: the DAGs Airflow's user may read); default: every job in full.
    :raises ValueError: a bad limit in the environment.
    """
    made: list[GpuBroker] = [broker] if broker is not None else []
    limits = limits if limits is not None else ApiLimits.from_env()
    expected_ui_token = ui_token if ui_token is not None else get_option("ui_token") or None
    body_context = {"max_metrics_bytes": limits.max_metrics_bytes}

    def own_deployment() -> str:  # through Airflow's conf where there is one (its _CMD forms too)
        try:
            return deployment if deployment is not None else default_deployment(conf=airflow_conf())
        except ValueError as exc:  # this server's configuration: no request mends it
            raise HTTPException(500, f"this server's {exc}") from None

    def get_broker() -> GpuBroker:
        if not made:  # created on first use: importing the app must not touch a database
            made.append(GpuBroker(url_factory() if url_factory else broker_url, migrate=True))
        return made[0]

    BrokerDep = Annotated[GpuBroker, Depends(get_broker)]

    def viewer_of(viewer: Annotated[Viewer, Depends(ui_viewer or reads_all)]) -> Viewer:
        """The request's viewer; one limited to some DAGs reads those of this server's deployment (a
        broker that deployments share has another deployment's DAG of the same id: another DAG)."""
        return viewer if viewer.dag_ids is None else replace(viewer, deployment=own_deployment())

    ViewerDep = Annotated[Viewer, Depends(viewer_of)]
    timelines: dict[str, tuple[int, float, TimelineOut]] = {}  # pool -> (its newest event's id, when, its timeline then)

    def hidden_jobs(b: GpuBroker, viewer: Viewer, job_ids: Iterable[str | None],
                    known: Iterable[JobOut] = ()) -> set[str]:
        """The ids among ``job_ids`` of jobs ``viewer`` reads without their story (``known``: read already)."""
        if viewer.dag_ids is None:
            return set()
        keys = {j.id: (j.key, j.family) for j in known}
        keys.update(b.job_keys([i for i in set(job_ids) if i is not None and i not in keys]))
        return {i for i, (key, family) in keys.items() if viewer.hides(key, family)}

    def job_auth(job_id: str,
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token: send the job's API token",
                                headers={"WWW-Authenticate": "Bearer", **ABOUT_THE_JOB})
        # the broker (its database) only then: a request without a token is refused whatever its state;
        # no job has a NUL in its id, and PostgreSQL refuses one in text (a 500 before any token check)
        if "\x00" in job_id or not get_broker().verify_token(job_id, credentials.credentials):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"the token is not valid for job {job_id!r}",
                                headers=ABOUT_THE_JOB)
        return job_id

    JobAuth = Annotated[str, Depends(job_auth)]

    def live_job_auth(job_id: JobAuth, b: BrokerDep) -> str:
        job_status = b.target(job_id).status
        if job_status.terminal:
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                f"job {job_id!r} has ended ({job_status.value}): its token no longer changes it",
                                headers=ABOUT_THE_JOB)
        return job_id

    LiveJobAuth = Annotated[str, Depends(live_job_auth)]

    def body_of(model: type[BaseModel], auth: Callable[..., str]) -> Callable[..., Any]:
        """A dependency: the request's body as ``model``, read only once ``auth`` has passed."""

        async def read(request: Request, _job_id: Annotated[str, Depends(auth)]) -> BaseModel:
            return parse_body(await request.body(), model, body_context)

        return read

    def check_ui_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
                       request: Request) -> None:
        if not expected_ui_token:
            return
        # ?token= opens the page only (its address, which it sends on as a header): in the views' URLs,
        # and the next-page links that repeat them, it would reach proxies' and servers' logs
        page = getattr(request.scope.get("route"), "path", None) == "/ui"
        given = credentials.credentials if credentials else request.query_params.get("token", "") if page else ""
        if not hmac.compare_digest(given.encode(), expected_ui_token.encode()):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this view needs the UI token",
                                headers={"WWW-Authenticate": "Bearer"})

    guards = [Depends(d) for d in (ui_dependencies if ui_dependencies is not None else [check_ui_token])]

    app = FastAPI(
        title="airflow-elastic-gpu broker API",
        version="1",
        description=__doc__,
        root_path=root_path,
        docs_url="/docs" if api_docs else None,
        redoc_url="/redoc" if api_docs else None,
    )
    # the last added runs first: the size limit answers before anything else runs
    app.add_middleware(SecurityHeaders, page_paths=frozenset(PAGE_ASSETS) | {"/ui"})
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request: Request, exc: InvalidRequest) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(exc)})

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)}, headers=ABOUT_THE_JOB)

    sidecar = APIRouter(prefix=f"{API_PREFIX}/jobs/{{job_id}}", tags=["sidecar"], responses={
        401: {"description": "no bearer token"},
        403: {"description": "not this job's token; or, for progress and ack, the job has ended"},
        413: {"description": f"the body is larger than {limits.max_body_bytes} bytes (not read)"},
    })

    @sidecar.post("/heartbeat", response_model=TargetOut, summary="agent liveness; returns the target")
    def heartbeat(job_id: JobAuth, b: BrokerDep) -> TargetOut:
        return target_out(b.heartbeat(job_id))

    @sidecar.get("/target", response_model=TargetOut, summary="the latest published generation")
    def target(job_id: JobAuth, b: BrokerDep) -> TargetOut:
        return target_out(b.target(job_id))

    @sidecar.post("/progress", status_code=204, summary="the trainer reached a step",
                  openapi_extra=request_body(ProgressIn))
    def progress(job_id: LiveJobAuth, body: Annotated[ProgressIn, Depends(body_of(ProgressIn, live_job_auth))],
                 b: BrokerDep) -> None:
        b.progress(job_id, body.step, generation=body.generation)  # timed by the broker's clock

    @sidecar.post("/ack", response_model=AckOut, summary="the trainer runs on this generation's GPUs",
                  openapi_extra=request_body(AckIn))
    def ack(job_id: LiveJobAuth, body: Annotated[AckIn, Depends(body_of(AckIn, live_job_auth))],
            b: BrokerDep) -> AckOut:
        return AckOut(accepted=b.ack(job_id, body.generation, node=body.node))

    @sidecar.post("/finish", response_model=JobOut, summary="the trainer exited with 0",
                  openapi_extra=request_body(FinishIn))
    def finish(job_id: JobAuth, body: Annotated[FinishIn, Depends(body_of(FinishIn, job_auth))],
               b: BrokerDep) -> JobOut:
        return job_out(b.finish(job_id, body.exit_code, body.metrics, node=body.node))

    @sidecar.post("/fail", response_model=JobOut, summary="the job cannot go on",
                  openapi_extra=request_body(FailIn))
    def fail(job_id: JobAuth, body: Annotated[FailIn, Depends(body_of(FailIn, job_auth))],
             b: BrokerDep) -> JobOut:
        return job_out(b.fail(job_id, body.reason, body.exit_code, body.metrics, node=body.node))

    # the guards first: a request without the UI token learns nothing, not even of a NUL
    ui = APIRouter(prefix=API_PREFIX, tags=["ui"], dependencies=[*guards, Depends(no_nul_parameters)])

    @ui.get("/pools", response_model=list[str])
    def pools(b: BrokerDep) -> list[str]:
        return b.pools()

    @ui.get("/pools/{pool}/snapshot", response_model=SnapshotOut)
    def snapshot(pool: str, b: BrokerDep, viewer: ViewerDep, events: Annotated[int, Query(ge=0, le=10_000)] = 50,
                 ended: Annotated[int, Query(ge=0, le=MAX_JOBS_PAGE)] = 100) -> SnapshotOut:
        if pool not in b.pools():
            raise NotFound(f"unknown GPU pool {pool!r}")
        snap = snapshot_out(b.snapshot(pool, events=events, ended=ended))
        hidden = hidden_jobs(b, viewer, (e.job_id for e in snap.events), snap.jobs)
        return snap.model_copy(update={"jobs": [viewer.job(j) for j in snap.jobs],
                                       "events": [viewer.event(e, hidden) for e in snap.events]})

    @ui.get("/pools/{pool}/timeline", response_model=TimelineOut)
    def pool_timeline(pool: str, b: BrokerDep, viewer: ViewerDep) -> TimelineOut:
        if pool not in b.pools():
            raise NotFound(f"unknown GPU pool {pool!r}")
        # made again only after a new event of the pool (an ack or an end moves a bar), or once
        # TIMELINE_MAX_AGE_S old: every open page asks every 2 s, and a timeline reads up to
        # TIMELINE_EVENTS events. (On PostgreSQL an event's id is taken at its INSERT and seen at its
        # COMMIT: an ack committed after a later event's, the newest id did not change, and its bar
        # was missing until the pool's next event, hours in a quiet pool.)
        newest, now = b.events(pool, limit=1, latest=True), b.clock()
        mark = newest[-1].id if newest else 0
        cached = timelines.get(pool)
        if cached is None or cached[0] != mark or not 0 <= now - cached[1] < TIMELINE_MAX_AGE_S:
            cached = timelines[pool] = (mark, now, timeline(b, pool))
        tl = cached[2].model_copy(update={"time_s": now})
        hidden = hidden_jobs(b, viewer, [s.job_id for s in tl.segments] + [e.job_id for e in tl.resizes])
        return tl.model_copy(update={"segments": [viewer.segment(s, hidden) for s in tl.segments],
                                     "resizes": [viewer.event(e, hidden) for e in tl.resizes]})

    @ui.get("/jobs", response_model=list[JobOut])
    def jobs(request: Request, response: Response, b: BrokerDep, viewer: ViewerDep, pool: str | None = None,
             active: bool = False, limit: Annotated[int, Query(ge=1, le=MAX_JOBS_PAGE)] = JOBS_PAGE,
             offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
             after: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
             order: Annotated[str, Query(pattern="^(asc|desc)$")] = "asc") -> list[JobOut]:
        """One page of jobs in submit order (``order=desc``: newest first), after the first ``offset``
        and after job ``after``; ``X-Total-Count`` says how many match (``after`` aside), and a ``Link``
        header with ``rel="next"`` gives the next page while there is one: the jobs after this page's
        last (a job that ends or is removed meanwhile moves no other out of the next page, as it
        would with an offset), a reference relative to this URL (RFC 8288, so that it holds behind a
        proxy and under Airflow's plugin prefix)."""
        response.headers["X-Total-Count"] = str(b.count_jobs(pool, active_only=active))
        page = b.jobs(pool, active_only=active, limit=limit + 1, offset=offset, newest_first=order == "desc",
                      after=after)
        if len(page) > limit:
            page = page[:limit]
            url = request.url.remove_query_params("offset").include_query_params(after=page[-1].id)
            response.headers["Link"] = f'<?{url.query}>; rel="next"'
        return [viewer.job(job_out(j)) for j in page]

    airflow_id = Annotated[str, Query(min_length=1, max_length=250)]

    @ui.get("/jobs/by-task", response_model=JobOut)
    def job_of_task(b: BrokerDep, viewer: ViewerDep, dag_id: airflow_id, task_id: airflow_id, run_id: airflow_id,
                    map_index: Annotated[int, Query(ge=-1, le=MAX_ID)] = -1,
                    deployment: Annotated[str | None, Query(pattern=f"^(|{DEPLOYMENT_PATTERN.pattern})$")] = None,
                    ) -> JobOut:
        """The job an Airflow task instance submitted (its latest: a retry's job when a try
        replaced the one before), of Airflow deployment ``deployment`` (default the server's
        ``[elastic_gpu] deployment``; ``""``: none); 404 when it has submitted none."""
        name = deployment if deployment is not None else own_deployment()
        job = b.job_by_key(task_key(dag_id, task_id, run_id, map_index, deployment=name))
        if job is None or viewer.hides(job.key, job.family):  # a DAG it may not read: none to see
            where = f"{dag_id}.{task_id} (run {run_id}" + ("" if map_index < 0 else f", map index {map_index}") + ")"
            raise NotFound(f"task {where} has submitted no GPU job (yet)")
        return job_out(job)

    @ui.get("/jobs/{job_id}", response_model=JobOut)
    def job(job_id: str, b: BrokerDep, viewer: ViewerDep) -> JobOut:
        return viewer.job(job_out(b.job(job_id)))

    @ui.get("/events", response_model=list[EventOut])
    def events(b: BrokerDep, viewer: ViewerDep, pool: str | None = None, job_id: str | None = None,
               after_id: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[EventOut]:
        found = [event_out(e) for e in b.events(pool, job_id=job_id, after_id=after_id, limit=limit)]
        hidden = hidden_jobs(b, viewer, (e.job_id for e in found))
        return [viewer.event(e, hidden) for e in found]

    page = APIRouter(dependencies=guards, include_in_schema=False)

    @page.get("/ui", response_class=HTMLResponse)
    def ui_page(pool: str = DEFAULT_POOL) -> HTMLResponse:
        return HTMLResponse((STATIC / "pool.html").read_text())

    # the page's script, style and plotly.js hold no data: served without the guard, so that the
    # page's <script src> works with ?token= and inside Airflow alike
    assets = APIRouter(include_in_schema=False)
    for path, (file, media_type) in PAGE_ASSETS.items():
        assets.add_api_route(path, _file_route(file, media_type), methods=["GET"])

    @assets.get("/")
    def root(request: Request) -> RedirectResponse:
        """The page, for whoever opens the server's address (relative: mounted inside Airflow too)."""
        query = request.url.query
        return RedirectResponse("ui" + (f"?{query}" if query else ""), status_code=307)

    app.include_router(sidecar)
    app.include_router(ui)
    app.include_router(page)
    app.include_router(assets)
    return app


def _plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


#: the page's assets: path -> (file, or a function giving it; media type)
PAGE_ASSETS: dict[str, tuple[Path | Callable[[], Path], str]] = {
    "/ui/pool.js": (STATIC / "pool.js", "text/javascript"),
    "/ui/pool.css": (STATIC / "pool.css", "text/css"),
    "/ui/plotly.min.js": (_plotly_js, "text/javascript"),
}


def _file_route(file: Path | Callable[[], Path], media_type: str) -> Callable[[], FileResponse]:
    def serve() -> FileResponse:
        return FileResponse(file if isinstance(file, Path) else file(), media_type=media_type)

    return serve
