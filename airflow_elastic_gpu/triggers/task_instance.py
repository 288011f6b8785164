"""What a training job records of the Airflow task instance that submitted it, read the same way
by the operator (in a worker) and by the trigger (in the triggerer): its key, the try it belongs
to, and what tells a retry from a clear."""

from __future__ import annotations

import contextlib
from typing import Any

from airflow_elastic_gpu.broker import types
from airflow_elastic_gpu.compat import AirflowFailException
from airflow_elastic_gpu.config import airflow_conf, default_deployment


def task_key(ti: Any) -> str:
    """The job key of task instance ``ti`` in this Airflow deployment
    (:func:`~airflow_elastic_gpu.broker.types.task_key`, ``[elastic_gpu] deployment``).

    :raises AirflowFailException: ``[elastic_gpu] deployment`` is not a valid name (no retry mends it)."""
    try:
        deployment = default_deployment(conf=airflow_conf())
    except ValueError as exc:
        raise AirflowFailException(str(exc)) from None
    return types.task_key(ti.dag_id, ti.task_id, ti.run_id, ti.map_index, deployment=deployment)


def job_name_of(ti: Any, given: str | None = None) -> str:
    """The name of task instance ``ti``'s job: ``given`` (the operator's ``job_name``), else its task
    id, with ``[map index]`` for a mapped task's instance."""
    map_index = int(ti.map_index)
    return given or (ti.task_id if map_index < 0 else f"{ti.task_id}[{map_index}]")


def attempt_of(ti: Any) -> str | None:
    """The task try's identity (``JobSpec.attempt``): the task instance's id, which Airflow 3 makes
    anew for every try; None when it has none."""
    ti_id = getattr(ti, "id", None)
    return None if ti_id is None else str(ti_id)


def max_tries_of(ti: Any) -> int | None:
    """The worker's task instance's ``max_tries`` (``JobSpec.max_tries``: Airflow raises it when the
    task is cleared, never on a retry); None where it has none. Not for the triggerer's task
    instance, built without it (its ``max_tries`` reads 0 for every try, a clear's too)."""
    return _count(getattr(ti, "max_tries", None))


def clear_number_of(context: Any) -> int | None:
    """The ``clear_number`` of the worker's DAG run (``JobSpec.clear_number``: Airflow raises it on
    every clear of the run, never on a retry) in the task's ``context``; None where it has none."""
    return _count(getattr(context.get("dag_run"), "clear_number", None))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def will_retry(ti: Any, task: Any, exc: BaseException, never: type[BaseException], context: Any = None) -> bool:
    """Whether Airflow retries task instance ``ti`` (of ``task``) after ``exc``, decided as Airflow
    3's task runner does: not on ``never`` (``AirflowFailException``), nor when the task's
    ``retry_policy`` says FAIL; else as the API server said when the try started (``should_retry``),
    or, where that is not known, while ``try_number <= max_tries``. Unknown: True (a job is then
    left to a retry that may come). ``context``: the task's, for the policy."""
    if isinstance(exc, never):
        return False
    policy, server = getattr(task, "retry_policy", None), getattr(ti, "_ti_context_from_server", None)
    max_tries = max_tries_of(ti)
    if policy is not None:
        with contextlib.suppress(Exception):  # Airflow falls back to its default then too
            action = policy.evaluate(exception=exc, try_number=ti.try_number, max_tries=max_tries or 0, context=context)
            if str(getattr(action.action, "value", action.action)).lower() == "fail":
                return False
    if isinstance(getattr(server, "should_retry", None), bool):
        return server.should_retry
    try_number = getattr(ti, "try_number", None)
    return not isinstance(try_number, int) or max_tries is None or try_number <= max_tries
