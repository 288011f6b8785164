"""What the local backend leaves on disk, and which of it no job needs any more.

The backend never deletes what a job wrote: a job's directory (``<work_dir>/<job id>``: the
launcher's files and the trainer's log) stays for reading after the job, and a task's default
checkpoint directory (:mod:`.local_checkpoints`) stays for its next try, or, renamed
``<dir>@<job id>``, as the result of a successful run. :func:`leftovers` finds those whose job
ended more than a given age ago, as the broker records it; ``airflow-elastic-gpu cleanup``
removes them (``--dry-run`` lists them). A directory of a job the broker does not know (another
broker's, or a job the broker's database no longer has) or of a job still queued, running or
suspended is never listed.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import Timeout

from airflow_elastic_gpu.backends import local_checkpoints
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobView, NotFound

_JOB_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
JOB_DIRECTORY = "job directory"
CHECKPOINT = "checkpoint"  # a task's default checkpoint directory whose last job ended (not renamed)
KEPT_CHECKPOINT = "checkpoint of a success"  # renamed <dir>@<job id>
INTERRUPTED = "interrupted removal"  # .<dir>.removing-<job id>: a cleanup stopped before it was deleted


@dataclass(frozen=True)
class Leftover:
    """A directory whose job ended ``age_s`` seconds ago.

    :param path: the directory.
    :param kind: :data:`JOB_DIRECTORY`, :data:`CHECKPOINT`, :data:`KEPT_CHECKPOINT` or
        :data:`INTERRUPTED`.
    :param job: the job it belongs to (its last one, for a checkpoint directory).
    :param age_s: seconds since the job ended (broker clock).
    :param size_bytes: the bytes of the files under it.
    """

    path: Path
    kind: str
    job: JobView
    age_s: float
    size_bytes: int


def _size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:  # removed meanwhile, or unreadable: not counted
            continue
    return total


def _candidates(work_dir: Path) -> Iterator[tuple[Path, str, str]]:
    """``(directory, kind, job id)`` of every directory under ``work_dir`` that names its job."""
    for p in sorted(work_dir.iterdir()) if work_dir.is_dir() else ():
        if p.is_dir() and not p.is_symlink() and _JOB_ID.fullmatch(p.name):
            yield p, JOB_DIRECTORY, p.name
    checkpoints = work_dir / "checkpoints"
    for p in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else ():
        if not p.is_dir() or p.is_symlink():
            continue
        doomed, removing, job_id = p.name.rpartition(".removing-")
        if removing and doomed.startswith(".") and _JOB_ID.fullmatch(job_id):
            yield p, INTERRUPTED, job_id
            continue
        _, at, job_id = p.name.rpartition("@")
        if at and _JOB_ID.fullmatch(job_id):
            yield p, KEPT_CHECKPOINT, job_id
            continue
        try:
            job_id = local_checkpoints.owner_of(p)  # "": never claimed, nothing says whose it is
        except OSError:  # unreadable
            continue
        if _JOB_ID.fullmatch(job_id):
            yield p, CHECKPOINT, job_id


def leftovers(broker: GpuBroker, work_dir: Path, older_than_s: float,
              is_running: Callable[[str], bool] | None = None) -> list[Leftover]:
    """The directories under ``work_dir`` whose job ended at least ``older_than_s`` seconds ago.

    :param work_dir: the local backend's work directory (``[elastic_gpu] work_dir``).
    :param older_than_s: the least age of the job's end (seconds, >= 0).
    :param is_running: whether a job's processes still run (default: the local backend's
        :meth:`~.local.LocalBackend.has_processes` on ``work_dir``): such a job's are not listed.
    :raises ValueError: a negative or non-finite ``older_than_s``.
    """
    if not 0 <= older_than_s < float("inf"):
        raise ValueError(f"the age must be a number of days >= 0, got {older_than_s / 86400!r}")
    if is_running is None:
        from airflow_elastic_gpu.backends.local import LocalBackend

        is_running = LocalBackend(work_dir, broker).has_processes  # a trainer left by its launcher too
    now = broker.clock()
    found = []
    jobs: dict[str, JobView | None] = {}  # a job's directory and its checkpoint: the broker asked once
    for path, kind, job_id in _candidates(work_dir):
        if job_id not in jobs:
            try:
                jobs[job_id] = broker.job(job_id)
            except NotFound:
                jobs[job_id] = None
        if (job := jobs[job_id]) is None:
            continue
        if not job.status.terminal or job.end_s is None or now - job.end_s < older_than_s or is_running(job_id):
            continue
        found.append(Leftover(path, kind, job, now - job.end_s, _size(path)))
    return found


def remove(leftover: Leftover) -> bool:
    """Delete ``leftover``'s directory (and a checkpoint directory's ``.owner`` record); False, and
    nothing deleted, if a new job of the task has claimed the checkpoint directory since it was
    listed (a retry resumes from it), or the checkpoints directory's lock stays held for 30 s.

    :raises OSError: it cannot be deleted (a permission).
    """
    if leftover.kind != CHECKPOINT:
        shutil.rmtree(leftover.path)
        return True
    path = leftover.path
    doomed = path.with_name(f".{path.name}.removing-{leftover.job.id}")  # listed again if the rmtree stops
    try:
        with local_checkpoints.lock(path):  # a claim now waits; one before it changed the owner
            if local_checkpoints.owner_of(path) != leftover.job.id:
                return False
            path.rename(doomed)  # out of the way at once: a claim after this starts anew
            local_checkpoints.owner_path(path).unlink(missing_ok=True)
    except Timeout:
        return False
    shutil.rmtree(doomed)
    return True
