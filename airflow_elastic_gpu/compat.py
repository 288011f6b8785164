"""Airflow imports in one place: the Task SDK (``airflow.sdk``) where the supported floor
(Airflow 3.1) has the name there, else its older home.

Everything else imports Airflow names from here, so a move between Airflow versions is one edit.
"""

from __future__ import annotations

from airflow.sdk import Asset, BaseHook, BaseOperator, BaseOperatorLink, Metadata, XComArg

try:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred
except ImportError:  # pragma: no cover - Airflow 3.1's task SDK re-exports them from core
    from airflow.exceptions import AirflowException, AirflowFailException, TaskDeferred

try:
    from airflow.sdk.execution_time.xcom import XCom
except ImportError:  # pragma: no cover - older task SDK
    from airflow.models.xcom import XCom

# Triggers have no Task SDK home yet (Airflow 3.3 keeps them in core).
from airflow.triggers.base import BaseTrigger, StartTriggerArgs, TriggerEvent

__all__ = ["AirflowException", "AirflowFailException", "Asset", "BaseHook", "BaseOperator", "BaseOperatorLink", "BaseTrigger",
           "Metadata", "StartTriggerArgs", "TaskDeferred", "TriggerEvent", "XCom", "XComArg",
           "resolved_later"]


def resolved_later(value: object) -> bool:
    """Whether a template field's value is resolved only when the task runs (an upstream task's
    output, ``XComArg``, or a mapped task group's argument: what Airflow resolves, by its
    ``resolve``/``iter_references`` protocol), so checked then rather than when the DAG is parsed."""
    return isinstance(value, XComArg) or (hasattr(value, "resolve") and hasattr(value, "iter_references"))
