"""What guards the broker API against hostile or careless clients: the request size limits, strict
JSON bodies, and the security headers of every answer.

* :class:`ApiLimits`: how large a request body and a job's ``metrics`` may be.
* :class:`BodySizeLimit`: an ASGI middleware that refuses a larger body **before reading it** (by its
  ``Content-Length``, and by counting a streamed body as it arrives): 413.
* :func:`parse_body`: a JSON body into a request model; finite numbers only; every malformed body
  a 422 (never a 500).
* :class:`SecurityHeaders`: ``X-Content-Type-Options: nosniff`` on every answer, and the page's
  Content-Security-Policy on the page and its assets.
* :func:`no_nul_parameters`: a path or query parameter with a NUL character never reaches the
  database (PostgreSQL refuses NUL in text: a 500).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from airflow_elastic_gpu.config import lookup_option
from airflow_elastic_gpu.sidecar.protocol import BROKER_HEADER

#: The page's Content-Security-Policy: its scripts only from this server (no inline script, no eval),
#: data only from this server, no plugins, no ``<base>``, no forms, framed only by its own origin
#: (Airflow shows plugin pages in an iframe of its own UI). Styles may be inline: plotly.js sets
#: them on the elements it draws.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'self'"
)
PAGE_HEADERS: dict[str, str] = {
    "Content-Security-Policy": PAGE_CSP,
    "X-Frame-Options": "SAMEORIGIN",
    # the page may carry the UI token in its query string: never send it on as a Referer
    "Referrer-Policy": "no-referrer",
}

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ApiLimits:
    """What one request to the broker API may carry.

    :param max_body_bytes: a request body, in bytes. Refused with 413 before it is read. The default,
        256 KiB, is above the largest valid report (a fail with a 20,000-character reason, JSON-escaped,
        and the largest ``metrics``).
    :param max_metrics_bytes: a finish or fail report's ``metrics``, in bytes of compact UTF-8 JSON:
        422 above. The page sends every job's metrics to every viewer every 2 seconds.
    :raises ValueError: a limit that is not a positive integer, or metrics larger than the body.
    """

    max_body_bytes: int = 256 * 1024
    max_metrics_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_metrics_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (bytes), got {value!r}")
        if self.max_metrics_bytes > self.max_body_bytes:
            raise ValueError(f"max_metrics_bytes ({self.max_metrics_bytes}) must not exceed max_body_bytes "
                             f"({self.max_body_bytes}): the metrics travel in the body")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, *, given: Mapping[str, int] | None = None) -> ApiLimits:
        """``[elastic_gpu] api_max_body_bytes`` and ``api_max_metrics_bytes``
        (``$AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES``, ``$AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES``,
        which win when set), else the defaults; see :mod:`airflow_elastic_gpu.config`.

        :param given: limits set by the caller (command-line options, by field name): they win,
            and the settings they replace are not read (a malformed one is then no error).
        :raises ValueError: a value that is not a positive integer, or a metrics limit above the
            body limit (the message names each value's source).
        """
        values: dict[str, int] = dict(given or {})
        sources = {name: f"--{name.replace('_', '-')}" for name in values}
        for name in ("max_body_bytes", "max_metrics_bytes"):
            if name in values:
                value = values[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{sources[name]} must be a positive integer (bytes), got {value!r}")
                continue
            raw, sources[name] = lookup_option(f"api_{name}", environ)
            try:
                values[name] = int(raw)
            except ValueError:
                values[name] = 0
            if values[name] < 1:
                raise ValueError(f"{sources[name]} must be a positive integer (bytes), got {raw!r}")
        if values["max_metrics_bytes"] > values["max_body_bytes"]:
            raise ValueError(f"{sources['max_metrics_bytes']} ({values['max_metrics_bytes']}) must not exceed "
                             f"{sources['max_body_bytes']} ({values['max_body_bytes']}): the metrics travel in "
                             "the body")
        return cls(**values)


def no_nul_parameters(request: Request) -> None:
    """A dependency of the read-only views: a parameter holding a NUL character (``%00``) is answered
    before any database is asked, as PostgreSQL refuses NUL in text (psycopg's ``DataError`` was a 500).

    :raises HTTPException: 404 for a path parameter (no pool or job has such a name), 422 for a
        query parameter.
    """
    for name, value in request.path_params.items():
        if isinstance(value, str) and "\x00" in value:
            raise HTTPException(404, f"no such {name}: the name holds a NUL character")
    for name, value in request.query_params.multi_items():
        if "\x00" in name or "\x00" in value:
            raise HTTPException(422, f"query parameter {name!r} holds a NUL character")


class BodyTooLarge(Exception):
    """A streamed request body passed the limit while it was being read."""


def _too_large(max_body_bytes: int, declared: int | None) -> list[Message]:
    said = f" (Content-Length {declared})" if declared is not None else ""
    body = (b'{"detail":"the request body is larger than the %d bytes this API accepts%s"}'
            % (max_body_bytes, said.encode()))
    return [
        {"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-content-type-options", b"nosniff"),
            # the broker's own answer (this middleware is outside SecurityHeaders): an agent takes a
            # 4xx without it for a proxy's and retries, and a too large finish was never sent without
            # its metrics, the job then LOST
            (BROKER_HEADER.encode(), b"1"),
            (b"connection", b"close"),  # the server drops the connection instead of draining the body
        ]},
        {"type": "http.response.body", "body": body},
    ]


class BodySizeLimit:
    """ASGI middleware: a request body larger than ``max_body_bytes`` gets 413 without being read.

    A declared ``Content-Length`` above the limit is answered at once, before the application runs
    (so before any token check: a 413 says nothing about the job). A body without one (chunked) is
    counted as the application reads it, and the read stops at the limit; the application reads a
    body only after the request's token was checked.

    :param max_body_bytes: the limit, bytes.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            for message in _too_large(self.max_body_bytes, declared):
                await send(message)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(received)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            for message in _too_large(self.max_body_bytes, None):
                await send(message)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed one; the body is counted anyway
    return None




class SecurityHeaders:
    """ASGI middleware: ``X-Content-Type-Options: nosniff`` and :data:`BROKER_HEADER` on every
    answer, and :data:`PAGE_HEADERS` (the Content-Security-Policy) on answers to ``page_paths``.

    :param page_paths: request paths (below the app's ``root_path``) of the page and its assets.
    """

    def __init__(self, app: ASGIApp, page_paths: frozenset[str]) -> None:
        self.app = app
        self.page_paths = page_paths
        self.page_headers = [(k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        extra = [(b"x-content-type-options", b"nosniff"), (BROKER_HEADER.encode(), b"1")]
        if path in self.page_paths:
            extra += self.page_headers

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", ())}
                message = {**message, "headers": [*message.get("headers", ()),
                                                  *((k, v) for k, v in extra if k not in names)]}
            await send(message)

        await self.app(scope, receive, with_headers)


def parse_body(raw: bytes, model: type[M], context: dict[str, Any] | None = None) -> M:
    """``raw`` (a request body) as ``model``: strict JSON, then the model's rules.

    Strict JSON: ``NaN``, ``Infinity`` and numbers that overflow a double (``1e400``) are refused
    wherever they appear, so no non-finite number ever reaches the broker or a viewer; so is text
    with a NUL character or a lone surrogate, which the two databases would not store alike.

    :param context: passed to the model's validators (the metrics limit).
    :raises RequestValidationError: anything malformed; FastAPI answers 422 listing each error with
        its ``loc`` (starting at ``"body"``, as for FastAPI's own body parameters) and ``msg``. The
        input is not echoed back.
    """
    try:
        data = json.loads(raw, parse_constant=_not_finite, parse_float=_finite_float)
    except ValueError as exc:  # JSONDecodeError, a non-UTF-8 body, an integer of more than 4300 digits
        where = f" at position {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise _invalid(f"JSON decode error: {msg}{where}") from None
    except RecursionError:
        raise _invalid("JSON decode error: nested too deeply") from None
    bad = _bad_text(data)
    if bad is not None:
        where, msg = bad
        raise RequestValidationError([{"type": "string_type", "loc": ("body", *where), "msg": msg}])
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _bad_text(data: Any) -> tuple[tuple[str | int, ...], str] | None:
    """The first string (key or value) in ``data`` that no database stores alike, with why: a NUL
    character (PostgreSQL's text refuses it, SQLite keeps it) or a lone surrogate (not UTF-8)."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                shown = key[:40].encode("utf-8", "backslashreplace").decode()  # safe to send back
                stack.append(((*where, shown), key))
                stack.append(((*where, shown), item))
        elif isinstance(value, list):
            stack.extend(((*where, i), item) for i, item in enumerate(value))
        elif isinstance(value, str):
            if "\x00" in value:
                return where, "text must not contain NUL (\\u0000) characters"
            try:
                value.encode()
            except UnicodeEncodeError:
                return where, "text must be valid Unicode: a lone surrogate (\\ud800-\\udfff) is not"
    return None


def _invalid(msg: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": msg}])


def _not_finite(token: str) -> float:
    raise ValueError(f"{token} is not a finite number: JSON numbers must be finite")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"{token} is not a finite number: it overflows a double")
    return value
