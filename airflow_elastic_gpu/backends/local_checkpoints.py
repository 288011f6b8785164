"""The local backend's default checkpoint directories: one per task key, shared by a task's tries.

A job submitted without ``checkpoint_dir`` checkpoints in ``<work_dir>/checkpoints/<key>-<hash>``
(its key made a file name, with a hash of the whole key). An Airflow task's tries share a key
(dag, task, run, map index), so a retried task resumes from the checkpoint of the try that failed,
was lost or was stopped, rather than from step 0. The job that uses the directory is recorded next
to it (``<dir>.owner``): a job of the same key waits for an earlier one still stopping (its
trainer writes its last checkpoint), so two trainers never write one checkpoint. Once a job
succeeds the directory is renamed ``<dir>@<job id>``: kept, and out of the way of the task's next
run (a cleared task trains anew).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.broker.types import JobView

log = logging.getLogger(__name__)
DIR_MODE = 0o700


def default_dir(work_dir: Path, job: JobView) -> Path:
    """``<work_dir>/checkpoints/<key>-<hash>`` for ``job`` (the key of an ended job that a retry
    replaced, ``KEY@ID``, counts as ``KEY``)."""
    key = job.key.removesuffix(f"@{job.id}")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._-")[:100] or "job"
    return work_dir / "checkpoints" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _owner(path: Path) -> Path:
    return path.with_name(f"{path.name}.owner")


def claim(path: Path, job_id: str, is_running: Callable[[str], bool], wait_s: float) -> Path:
    """``path`` for job ``job_id``, once the job that used it before (its ``.owner``) no longer runs.

    :param is_running: whether a job's processes still run (``LocalBackend.is_running``).
    :param wait_s: how long to wait for them (seconds).
    :raises BackendError: the earlier job still runs after ``wait_s``, or the directory's parent
        cannot be made.
    """
    owner = _owner(path)
    previous = owner.read_text().strip() if owner.is_file() else ""
    if previous and previous != job_id:
        deadline = time.monotonic() + wait_s
        while is_running(previous) and time.monotonic() < deadline:
            time.sleep(0.2)
        if is_running(previous):
            raise BackendError(f"checkpoint directory {path} is still used by job {previous} (an earlier "
                               "try of this task, still stopping); try again once it has stopped")
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        owner.write_text(job_id)
    except OSError as exc:
        raise BackendError(f"checkpoint directory {path} cannot be prepared: {exc}") from None
    return path


def keep_after_success(path: Path, job_id: str) -> None:
    """Rename ``path`` to ``<path>@<job_id>`` (same parent: no copy) if job ``job_id`` used it last;
    a failure is logged, not raised (the job succeeded all the same)."""
    owner = _owner(path)
    try:
        if owner.read_text().strip() != job_id or not path.is_dir():
            return
        path.rename(path.with_name(f"{path.name}@{job_id}"))
        owner.unlink()
    except FileNotFoundError:
        return  # never claimed, or renamed already (a second stop)
    except OSError as exc:
        log.warning("job %s succeeded; its checkpoint directory %s stays where it is (%s): a later run "
                    "of its task would resume from it", job_id, path, exc)
