"""Airflow plugin: the broker API and the GPU pool page inside Airflow's api-server.

* ``fastapi_apps``: the broker API (:mod:`airflow_elastic_gpu.broker.api`) at ``/elastic-gpu``; its
  read-only part requires Airflow's authentication (the ``PLUGINS`` view permission) and shows a
  job of a DAG the user may not read without its story (:mod:`~airflow_elastic_gpu.broker.api_access`),
  the sidecar part the job's own token. The same limits (``$AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES``, ...) and
  page headers (Content-Security-Policy, framed by Airflow's own origin only) as stand-alone; no
  Swagger page of its own (``/elastic-gpu/openapi.json`` is served).
* ``external_views``: "GPU pool" in the navigation (Browse menu), the live page at ``/elastic-gpu/ui``;
  and "GPU job", a tab of every task instance: the page, finding the job the task instance submitted
  (while it trains too: a ``start_from_trigger`` task pushes its "GPU job" link only when it
  resumes in a worker, after the training). A task that submitted none says so.
* ``operator_extra_links``: "GPU job" on each training task instance.

The hrefs are relative to Airflow's base URL (an Airflow served under a sub-path finds them).

Registered through the ``airflow.plugins`` entry point, so installing the package is enough.
"""

from __future__ import annotations

import time
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from airflow_elastic_gpu.links.job import UI_PREFIX, ElasticJobLink


def _ui_auth() -> list:
    """Airflow's login for the page's read-only views (the plugins view permission). Where this
    Airflow has no such check, every view is refused: never open to anyone who reaches Airflow."""
    try:
        from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
        from airflow.api_fastapi.core_api.security import requires_access_view
    except ImportError:  # pragma: no cover - an Airflow that moved them
        return [_refused]
    return [requires_access_view(AccessView.PLUGINS)]


READABLE_DAGS_TTL_S = 30.0
"""How long the DAGs a user may read are kept before Airflow is asked again (the page refreshes
every 2 s; a role changed takes effect within this time)."""
_READABLE: dict[str, tuple[float, frozenset[str]]] = {}


def readable_dags(auth_manager: Any, user: Any, now_s: float | None = None) -> frozenset[str]:
    """The DAGs ``user`` may read (``auth_manager.get_authorized_dag_ids``), at most
    :data:`READABLE_DAGS_TTL_S` old."""
    now = time.monotonic() if now_s is None else now_s
    key = str(user.get_id())
    hit = _READABLE.get(key)
    if hit is None or now - hit[0] >= READABLE_DAGS_TTL_S:
        hit = _READABLE[key] = (now, frozenset(auth_manager.get_authorized_dag_ids(user=user, method="GET")))
    return hit[1]


def _ui_viewer() -> Any:
    """The read-only views' :class:`~.api_access.Viewer`: a job of a DAG Airflow's user may not read
    (per-DAG permissions) is shown without its name, reason, metrics and event messages. None where
    this Airflow has no such helpers (its views are refused then: :func:`_ui_auth`)."""
    try:
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.core_api.security import get_user
        from fastapi import Depends
    except ImportError:  # pragma: no cover - an Airflow that moved them
        return None
    from airflow_elastic_gpu.broker.api_access import Viewer

    def viewer(user: Any = Depends(get_user)) -> Viewer:  # noqa: B008 - FastAPI's way
        return Viewer(readable_dags(get_auth_manager(), user))

    return viewer


def _refused() -> None:
    from fastapi import HTTPException

    raise HTTPException(403, "the GPU pool page cannot check Airflow's login on this Airflow version; "
                             "use the broker's own server (airflow-elastic-gpu broker serve)")


def _app():
    from airflow_elastic_gpu.broker.api import create_app
    from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

    return create_app(broker_url=None, url_factory=lambda: GpuBrokerHook().get_url(),
                      ui_dependencies=_ui_auth(), ui_viewer=_ui_viewer())


class ElasticGpuPlugin(AirflowPlugin):
    name = "elastic_gpu"
    fastapi_apps = [{"app": _app(), "url_prefix": UI_PREFIX, "name": "Elastic GPU broker"}]
    external_views = [{
        "name": "GPU pool",
        "href": f"{UI_PREFIX.lstrip('/')}/ui",
        "destination": "nav",
        "category": "browse",
        "url_route": "elastic-gpu",
    }, {
        "name": "GPU job",
        # Airflow's UI fills the placeholders in (an unmapped task's map index may stay a placeholder:
        # the page reads it as -1)
        "href": f"{UI_PREFIX.lstrip('/')}/ui?dag_id={{DAG_ID}}&run_id={{RUN_ID}}&task_id={{TASK_ID}}"
                "&map_index={MAP_INDEX}",
        "destination": "task_instance",
        "url_route": "elastic-gpu-job",
    }]
    operator_extra_links = [ElasticJobLink()]
