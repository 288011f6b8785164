"""Operator extra link: from a training task instance to its job on the GPU pool page."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from airflow_elastic_gpu.compat import BaseOperatorLink, XCom

UI_PREFIX = "/elastic-gpu"


class ElasticJobLink(BaseOperatorLink):
    """"GPU job": opens ``/elastic-gpu/ui?pool=POOL&job=JOB_ID`` (the job is highlighted there).

    The job id and pool come from the task's XCom (``job_id``, ``gpu_pool``), pushed when the job
    was submitted (``start_from_trigger``: when the task resumed).
    """

    name = "GPU job"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        job_id = XCom.get_value(ti_key=ti_key, key="job_id")
        if not job_id:
            return ""
        pool = XCom.get_value(ti_key=ti_key, key="gpu_pool") or getattr(operator, "gpu_pool", None) or "default"
        query = {"pool": pool, "job": job_id}
        return f"{UI_PREFIX}/ui?{urlencode(query)}"
