"""Operator extra link: from a training task instance to its job on the GPU pool page."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from airflow_elastic_gpu.compat import BaseOperatorLink, XCom

UI_PREFIX = "/elastic-gpu"


class ElasticJobLink(BaseOperatorLink):
    """"GPU job": opens ``elastic-gpu/ui?pool=POOL&job=JOB_ID`` (the job is highlighted there),
    relative to Airflow's base URL (the UI's ``<base href>``: an Airflow served under a sub-path
    finds it as well).

    Airflow 3's API server does not call :meth:`get_link`: it reads the whole link from the task's
    XCom :attr:`xcom_key` (``_link_ElasticJobLink``), which :meth:`persist` pushes when the job is
    submitted (``start_from_trigger``: when the task resumes). :meth:`get_link` (Airflow 2's way,
    and the tests') builds it from the XComs ``job_id`` and ``gpu_pool`` pushed with it.
    """

    name = "GPU job"

    @staticmethod
    def url(pool: str, job_id: str) -> str:
        """The page's address for ``job_id`` of ``pool`` (relative to the Airflow base URL)."""
        return f"{UI_PREFIX.lstrip('/')}/ui?{urlencode({'pool': pool, 'job': job_id})}"

    @classmethod
    def persist(cls, ti: Any, *, pool: str, job_id: str) -> None:
        """Push the job's id, pool and link to the task instance ``ti``'s XCom."""
        ti.xcom_push(key="job_id", value=job_id)
        ti.xcom_push(key="gpu_pool", value=pool)
        ti.xcom_push(key=cls().xcom_key, value=cls.url(pool, job_id))

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        job_id = XCom.get_value(ti_key=ti_key, key="job_id")
        if not job_id:
            return ""
        pool = XCom.get_value(ti_key=ti_key, key="gpu_pool") or getattr(operator, "gpu_pool", None) or "default"
        return self.url(pool, job_id)
