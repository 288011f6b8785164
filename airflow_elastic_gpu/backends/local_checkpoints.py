"""The local backend's default checkpoint directories: one per task key, shared by a task's tries.

A job submitted without ``checkpoint_dir`` checkpoints in ``<work_dir>/checkpoints/<key>-<hash>``
(its key made a file name, with a hash of the whole key). An Airflow task's tries share a key
(dag, task, run, map index), so a retried task resumes from the checkpoint of the try that failed,
was lost or was stopped, rather than from step 0. The job that uses the directory is recorded next
to it (``<dir>.owner``): a job of the same key waits for an earlier one still stopping (its
trainer writes its last checkpoint), so two trainers never write one checkpoint. Once a job
succeeds the directory is renamed ``<dir>@<job id>``: kept, and out of the way of the task's next
run (a cleared task trains anew); where nothing stopped the job at its end (``run-local --detach``),
the next job of the key renames it when it claims the directory.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

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


def owner_path(path: Path) -> Path:
    """The file naming the job that used checkpoint directory ``path`` last (``<path>.owner``)."""
    return path.with_name(f"{path.name}.owner")


def owner_of(path: Path) -> str:
    """The job id in ``path``'s ``.owner``, or "" when there is none (never claimed, or removed
    by a rename or a cleanup between a look and the read)."""
    try:
        return owner_path(path).read_text().strip()
    except FileNotFoundError:
        return ""


def lock(path: Path, timeout_s: float = 30.0) -> FileLock:
    """The lock (one file, ``.lock``, in ``path``'s parent: the checkpoints directory) held while a
    checkpoint directory's ``.owner`` is read and changed together with the directory: by a claim,
    the rename after a success, and ``cleanup``'s removal, so none of them acts on an owner the
    other has just changed. Held for milliseconds; ``timeout_s`` raises ``filelock.Timeout``."""
    return FileLock(path.parent / ".lock", timeout=timeout_s)


def claim(path: Path, job_id: str, is_running: Callable[[str], bool], wait_s: float,
          succeeded: Callable[[str], bool] = lambda _: False) -> Path:
    """``path`` for job ``job_id``, once the job that used it before (its ``.owner``) no longer runs.
    If that job succeeded and nothing renamed its directory at its end (``run-local --detach``, a
    run interrupted with Ctrl-C, a stop that never came), it is renamed now (``<path>@<its id>``):
    the new job trains anew, as after any success.

    :param is_running: whether a job's processes still run (``LocalBackend.is_running``).
    :param wait_s: how long to wait for them (seconds).
    :param succeeded: whether a job succeeded (the broker's record).
    :raises BackendError: the earlier job still runs after ``wait_s``, the directory's parent
        cannot be made, or its :func:`lock` is not free within 30 s.
    """
    owner = owner_path(path)
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise BackendError(f"checkpoint directory {path} cannot be prepared: {exc}") from None
    deadline = time.monotonic() + wait_s
    while True:
        # the earlier job's state is asked outside the lock (a broker call may take its retries);
        # the owner is then checked again under it, unchanged, before the directory changes hands
        previous = owner_of(path)
        free = not previous or previous == job_id or not is_running(previous)
        renamed = free and previous not in ("", job_id) and succeeded(previous)
        try:
            with lock(path):
                if free and owner_of(path) == previous:
                    if renamed:
                        _rename_success(path, previous)
                    owner.write_text(job_id)
                    return path
        except Timeout:
            raise BackendError(f"checkpoint directory {path}: its lock {path.parent / '.lock'} is held "
                               "by another process for over 30 s") from None
        except OSError as exc:
            raise BackendError(f"checkpoint directory {path} cannot be prepared: {exc}") from None
        if free:
            continue  # the owner changed meanwhile: look again
        if time.monotonic() >= deadline:
            raise BackendError(f"checkpoint directory {path} is still used by job {previous} (an earlier "
                               "try of this task, still stopping); try again once it has stopped")
        time.sleep(0.2)


def _rename_success(path: Path, job_id: str) -> None:
    """Rename ``path`` to ``<path>@<job_id>`` (if it exists) and drop its owner record; the
    caller holds :func:`lock` and has checked that ``job_id`` owns it."""
    if path.is_dir():
        path.rename(path.with_name(f"{path.name}@{job_id}"))
    owner_path(path).unlink(missing_ok=True)


def keep_after_success(path: Path, job_id: str) -> None:
    """Rename ``path`` to ``<path>@<job_id>`` (same parent: no copy) if job ``job_id`` used it last;
    a failure is logged, not raised (the job succeeded all the same)."""
    try:
        with lock(path):
            if owner_of(path) == job_id:  # "" if never claimed, or renamed already (a second stop)
                _rename_success(path, job_id)
    except OSError as exc:
        log.warning("job %s succeeded; its checkpoint directory %s stays where it is (%s): a later run "
                    "of its task would resume from it", job_id, path, exc)
