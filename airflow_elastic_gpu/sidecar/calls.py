"""What the agent needs of the broker (:class:`BrokerTransport`) and what a failed call means to
it (:func:`classify`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from airflow_elastic_gpu.sidecar.http_transport import BrokerRejected, JobGone
from airflow_elastic_gpu.states import InvalidRequest, NotFound, Target


class Outcome(StrEnum):
    """What a broker call's answer means to the agent."""

    OK = "ok"
    TRANSIENT = "transient"  # the broker did not answer (DB or HTTP unavailable): retry later
    REJECTED = "rejected"  # the broker refused this report (invalid): drop it
    ENDED = "ended"  # the job ended or is unknown to the broker: stop the trainer


def classify(exc: BaseException) -> Outcome:
    """The :class:`Outcome` of a broker call that raised ``exc``.

    :class:`NotFound` (direct DB) and :class:`JobGone` (HTTP 401/403/404/410) mean the job ended
    or is unknown; :class:`InvalidRequest` and other :class:`BrokerRejected` (HTTP 4xx) a rejected
    report; anything else (``BrokerUnavailable``, SQLAlchemy's ``OperationalError``, ``OSError``...)
    is treated as transient: the agent keeps going and never renews the lease on it.
    """
    if isinstance(exc, (NotFound, JobGone)):
        return Outcome.ENDED
    if isinstance(exc, (InvalidRequest, BrokerRejected)):
        return Outcome.REJECTED
    return Outcome.TRANSIENT


class BrokerTransport(Protocol):
    """What the agent needs of the broker: :class:`GpuBroker` itself (direct DB), or an HTTP client."""

    def heartbeat(self, job_id: str) -> Target: ...
    def progress(self, job_id: str, step: float, *, generation: int | None = None,
                 time_s: float | None = None) -> None: ...
    def ack(self, job_id: str, generation: int, *, node: str | None = None) -> bool: ...
    def finish(self, job_id: str, exit_code: int = 0, metrics: dict[str, Any] | None = None, *,
               node: str | None = None) -> Any: ...
    def fail(self, job_id: str, reason: str, exit_code: int | None = None,
             metrics: dict[str, Any] | None = None, *, node: str | None = None) -> Any: ...
