"""The operator's checks of how it runs (polling, deferral, start from the triggerer), made when
the DAG is parsed: a mistake there fails the DAG's import with a message that names the argument."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_elastic_gpu.compat import AirflowFailException, resolved_later


def rendered_later(value: Any) -> bool:
    """Whether a template field's value is known only when the task runs: an upstream task's output
    (:func:`.resolved_later`) or a string with Jinja in it (an expression, statement or comment:
    ``"/ckpt/{{ run_id }}"``, rendered then)."""
    return resolved_later(value) or (isinstance(value, str) and any(m in value for m in ("{{", "{%", "{#")))


def check_modes(task_id: str, *, poll_interval: Any, deferrable: Any, start_from_trigger: Any,
                trigger_fields: Mapping[str, Any]) -> None:
    """Check the operator's run-mode arguments.

    :param poll_interval: seconds between polls of the job (a finite number > 0).
    :param deferrable: True or False (a string such as ``"false"`` is not taken for False).
    :param start_from_trigger: True or False; True needs ``deferrable``.
    :param trigger_fields: the arguments the trigger gets when the DAG is parsed under
        ``start_from_trigger`` (``command``, ``env``, ``checkpoint_dir``, ``job_name``): none may
        be an upstream task's output.
    :raises AirflowFailException: naming the argument and what is wrong with it.
    """
    for name, value in (("deferrable", deferrable), ("start_from_trigger", start_from_trigger)):
        if not isinstance(value, bool):
            raise AirflowFailException(f"{task_id}: {name} must be True or False, got {value!r}")
    if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) or not (
            0 < poll_interval < float("inf")):
        raise AirflowFailException(f"{task_id}: poll_interval must be a number of seconds > 0, got {poll_interval!r}")
    if start_from_trigger and not deferrable:
        raise AirflowFailException(f"{task_id}: start_from_trigger=True needs deferrable=True")
    if start_from_trigger:  # its trigger's arguments are fixed when the DAG is parsed
        upstream = [name for name, value in trigger_fields.items() if resolved_later(value) or (
            isinstance(value, Mapping) and any(resolved_later(v) for v in value.values()))]
        if upstream:
            raise AirflowFailException(
                f"{task_id}: start_from_trigger=True cannot take an upstream task's output ({', '.join(upstream)}): "
                "the trigger's arguments are fixed when the DAG is parsed; start the job from a worker "
                "(start_from_trigger=False)")
