"""What a viewer of the broker API's read-only views may read of each job.

Inside Airflow (the plugin) a user sees the GPU pool whole: every GPU, and which job holds it. But
a job submitted by a task of a DAG the user may not read (Airflow's per-DAG permissions, e.g. the
FAB auth manager's roles) is shown without what would tell its story: its name, key and family,
its reason (the trainer's last log lines) and metrics, and the messages of its events, which name
it. The stand-alone server (``broker serve``) has one token for every view: its viewers read all.

A job is an Airflow task's when its key is one the operator makes (``[deployment/]dag_id/task_id/
run_id/map_index``, a replaced try's with ``@<job id>`` after it) and its family is ``dag_id.task_id``;
a job submitted otherwise (the CLI, the API) belongs to no DAG and is shown to every viewer. A DAG
is a deployment's: on a broker that deployments share, another deployment's DAG of the same id is
another DAG, hidden. A key cut for length (its ids end in a hash) cannot be read back: such a job is
shown in full when its key begins with ``[deployment/]dag_id/`` and its family with ``dag_id.`` for
a DAG the viewer may read (a DAG id ``a`` does not open DAG ``a.b``'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_elastic_gpu.broker.api_models import EventOut, JobOut, Segment
from airflow_elastic_gpu.broker.types import task_key_parts

HIDDEN = "(a job of a DAG you cannot read)"
"""The name, and the event message, a viewer reads for a job of a DAG it may not read."""


def dag_of(key: str, family: str | None) -> str | None:
    """The DAG whose task submitted the job of ``key`` and ``family``; ``""`` when the key is a
    task's but cut for length (its DAG unknown); ``None`` for a job of no DAG."""
    task = _task_of(key, family)
    return task if task is None or task == "" else task[1]


def _task_of(key: str, family: str | None) -> tuple[str, str] | str | None:
    """``(deployment, dag_id)`` of the task that submitted the job of ``key`` and ``family``, ``""``
    for a task's key cut for length, ``None`` for a job of no DAG."""
    if "#" in key and family is not None and "." in family:  # cut: any id may have lost its end
        return ""
    parts = task_key_parts(key.split("@", 1)[0], family)  # a replaced try's KEY@ID as KEY
    return None if parts is None else (parts[0], parts[1])


@dataclass(frozen=True)
class Viewer:
    """Who reads the views: ``dag_ids`` the DAGs whose jobs it may read in full, ``None`` for all;
    ``deployment`` the Airflow deployment those DAGs are of (``""``: none named)."""

    dag_ids: frozenset[str] | None = None
    deployment: str = ""

    def hides(self, key: str, family: str | None) -> bool:
        """Whether the job of ``key`` and ``family`` is shown to this viewer without its story."""
        if self.dag_ids is None:
            return False
        task = _task_of(key, family)
        if task == "":  # a key cut for length: does it begin with a readable DAG's, of this deployment?
            own = f"{self.deployment}/" if self.deployment else ""
            return not any(key.startswith(f"{own}{d}/") and str(family).startswith(f"{d}.") for d in self.dag_ids)
        return task is not None and (task[0] != self.deployment or task[1] not in self.dag_ids)

    def job(self, job: JobOut) -> JobOut:
        """``job`` as this viewer reads it."""
        if not self.hides(job.key, job.family):
            return job
        return job.model_copy(update={"name": HIDDEN, "key": "", "family": "", "reason": None, "metrics": None})

    def event(self, event: EventOut, hidden: set[str]) -> EventOut:
        """``event`` as this viewer reads it, ``hidden`` the ids of the jobs it reads without their story."""
        if event.job_id is None or event.job_id not in hidden:
            return event
        return event.model_copy(update={"message": HIDDEN, "data": None})

    def segment(self, segment: Segment, hidden: set[str]) -> Segment:
        """A timeline bar as this viewer reads it."""
        return segment.model_copy(update={"name": HIDDEN}) if segment.job_id in hidden else segment


def reads_all() -> Viewer:
    """The viewer of a server whose views have one token for all (``broker serve``): every job in full."""
    return Viewer()
