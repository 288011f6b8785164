"""The agent's HTTP transport: the broker API with the job's bearer token, instead of a DB connection.

Standard library only (``urllib``) and the package's pure modules, so a sidecar container needs no database driver and never sees
the broker's database password. Transient failures (connection refused, 5xx, 408, 429) raise
:class:`BrokerUnavailable`; the agent keeps the trainer running and retries. A refusal raises
:class:`BrokerRejected` (a report the broker will never take: the agent drops it) or its subclass
:class:`JobGone` (401, 403, 404, 410: the job ended, its token stopped working, or it is unknown:
the agent stops the trainer). Those four count only when the broker itself answered (its
``x-elastic-gpu-broker`` header): from a proxy or ingress in front of it (a 404 while the API
restarts) they are transient. A redirect is never followed (urllib would send the token on to
wherever it points, and turn a POST into a GET): it is a transient failure whose message names
where it leads, so that the broker API URL can be set to that.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar.protocol import BROKER_HEADER, JOB_ANSWER_HEADER
from airflow_elastic_gpu.states import JobStatus, Target


class BrokerRejected(Exception):
    """The broker API refused a request (4xx): bad token, unknown job, invalid report.

    :param status: the HTTP status code.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class JobGone(BrokerRejected):
    """The broker API no longer serves the job (401, 403, 404, 410): it ended, or is unknown."""


GONE_STATUSES = frozenset({401, 403, 404, 410})
RETRY_STATUSES = frozenset({408, 429})


class BrokerUnavailable(Exception):
    """The broker API did not answer, or answered with a server error; worth retrying."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Every 3xx is raised as an :class:`urllib.error.HTTPError`, never followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class HttpBrokerTransport:
    """Calls ``{base_url}/api/v1/jobs/{job_id}/...`` with ``Authorization: Bearer {token}``.

    :param base_url: the API root, e.g. ``http://broker:8793`` or ``http://airflow:8080/elastic-gpu``.
    :param token: the job's API token (ignored when ``token_file`` is given).
    :param token_file: a file holding the token (a mounted Kubernetes Secret), read on each request
        so that a token rotated in the Secret reaches a running agent; a missing or empty file is a
        transient failure (:class:`BrokerUnavailable`).
    :param timeout_s: per-request timeout.
    :raises ValueError: a URL that is not http(s), or neither a token nor a token file.
    """

    def __init__(self, base_url: str, token: str = "", *, token_file: str | os.PathLike[str] | None = None,
                 timeout_s: float = 10.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"broker API URL must start with http:// or https://, got {base_url!r}")
        if not token and token_file is None:
            raise ValueError("the job's API token is empty")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.token_file = None if token_file is None else Path(token_file)
        self.timeout_s = timeout_s

    def _token(self) -> str:
        if self.token_file is None:
            return self.token
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise BrokerUnavailable(f"cannot read the job's token file: {exc}") from None
        if not token:
            raise BrokerUnavailable(f"the job's token file {self.token_file} is empty")
        return token

    def _call(self, method: str, job_id: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}/api/v1/jobs/{job_id}/{path}", data=data, method=method,
            headers={"Authorization": f"Bearer {self._token()}", "Content-Type": "application/json"},
        )
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            message = f"broker API {path}: HTTP {exc.code}: {detail}"
            if 300 <= exc.code < 400:
                where = exc.headers.get("Location") if exc.headers is not None else None
                raise BrokerUnavailable(f"broker API {path}: HTTP {exc.code}, a redirect to {where!r}, not followed "
                                        "(the job's token goes to the broker only): set the broker API URL to "
                                        "where it leads, e.g. https://") from None
            if exc.code >= 500 or exc.code in RETRY_STATUSES:
                raise BrokerUnavailable(message) from None
            headers = exc.headers if exc.headers is not None else {}
            if headers.get(BROKER_HEADER) is None:  # a 4xx too: a report taken for rejected is never sent again
                raise BrokerUnavailable(f"{message} (not from the broker: a proxy's answer, retried)") from None
            if exc.code in GONE_STATUSES:
                if headers.get(JOB_ANSWER_HEADER) is None:
                    raise BrokerUnavailable(f"{message} (the broker serves no such path: is the broker API URL "
                                            f"{self.base_url!r} right? Retried)") from None
                raise JobGone(message, exc.code) from None
            raise BrokerRejected(message, exc.code) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise BrokerUnavailable(f"broker API {self.base_url} unreachable: {exc}") from None
        return json.loads(raw) if raw else None

    @staticmethod
    def _target(data: dict[str, Any]) -> Target:
        gpus = tuple(sorted(GpuId(n, int(i)) for n, i in (g.rsplit(":", 1) for g in data["gpus"])))
        lease = data.get("lease_s")
        return Target(data["job_id"], JobStatus(data["status"]), int(data["generation"]), gpus,
                      float(lease) if isinstance(lease, (int, float)) and lease > 0 else None)

    def heartbeat(self, job_id: str) -> Target:
        return self._target(self._call("POST", job_id, "heartbeat"))

    def target(self, job_id: str) -> Target:
        return self._target(self._call("GET", job_id, "target"))

    def progress(self, job_id: str, step: float, *, generation: int | None = None,
                 time_s: float | None = None) -> None:
        self._call("POST", job_id, "progress", {"step": step, "generation": generation, "time_s": time_s})

    def ack(self, job_id: str, generation: int, *, node: str | None = None) -> bool:
        body: dict[str, Any] = {"generation": generation}
        if node is not None:
            body["node"] = node
        return bool(self._call("POST", job_id, "ack", body)["accepted"])

    def finish(self, job_id: str, exit_code: int = 0, metrics: dict[str, Any] | None = None, *,
               node: str | None = None) -> Any:
        body = {"exit_code": exit_code, "metrics": metrics}
        if node is not None:
            body["node"] = node
        return self._call("POST", job_id, "finish", body)

    def fail(self, job_id: str, reason: str, exit_code: int | None = None,
             metrics: dict[str, Any] | None = None, *, node: str | None = None) -> Any:
        body = {"reason": reason, "exit_code": exit_code, "metrics": metrics}
        if node is not None:
            body["node"] = node
        return self._call("POST", job_id, "fail", body)
