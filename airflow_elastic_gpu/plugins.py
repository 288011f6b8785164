"""Airflow plugin: the broker API and the GPU pool page inside Airflow's api-server.

* ``fastapi_apps``: the broker API (:mod:`airflow_elastic_gpu.broker.api`) at ``/elastic-gpu``; its
  read-only part requires Airflow's authentication (the ``PLUGINS`` view permission), the sidecar
  part the job's own token. The same limits (``$AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES``, ...) and
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


def _refused() -> None:
    from fastapi import HTTPException

    raise HTTPException(403, "the GPU pool page cannot check Airflow's login on this Airflow version; "
                             "use the broker's own server (airflow-elastic-gpu broker serve)")


def _app():
    from airflow_elastic_gpu.broker.api import create_app
    from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

    return create_app(broker_url=None, url_factory=lambda: GpuBrokerHook().get_url(),
                      ui_dependencies=_ui_auth())


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
