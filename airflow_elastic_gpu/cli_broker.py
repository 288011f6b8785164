"""How the CLI reaches its broker: the URL of an Airflow connection (``--conn-id``), and a notice while
an unreachable database is retried."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from rich.console import Console
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError

from airflow_elastic_gpu.config import mask_url


def from_connection(args: argparse.Namespace) -> None:
    """``--conn-id``: take the broker URL, and the pool of a command given none, from that Airflow
    connection, read as Airflow's own processes read it (its secrets backends, ``AIRFLOW_CONN_*``,
    the metadata DB), then as the tasks' hook reads its fields.

    :raises ValueError: ``--broker-url`` given too, Airflow not installed, no such connection, or
        one that cannot be read (a secrets backend that denies it).
    """
    if args.broker_url is not None:
        raise ValueError("give --broker-url or --conn-id, not both")
    # Airflow's set-up makes libraries log at INFO on stderr, and it warns of what is no concern of
    # a read (no Fernet key; the connection type's "_" in a URI): none of it is this command's output
    quiet = "AIRFLOW__LOGGING__NAMESPACE_LEVELS" not in os.environ
    if quiet:  # read when Airflow sets its logging up, at the import below; not left to child processes
        os.environ["AIRFLOW__LOGGING__NAMESPACE_LEVELS"] = "airflow.models=error alembic=warning"
    try:
        connection = _read(args.conn_id)
    finally:
        if quiet:
            os.environ.pop("AIRFLOW__LOGGING__NAMESPACE_LEVELS", None)
    from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

    hook = GpuBrokerHook(args.conn_id)
    hook.connection = connection
    args.broker_url = hook.get_url()
    args.connection_pool = hook.default_pool()


def _read(conn_id: str) -> Any:
    """The Airflow connection ``conn_id`` (see :func:`from_connection`).

    :raises ValueError: Airflow not installed, no such connection, or one that cannot be read.
    """
    try:
        from airflow.exceptions import AirflowNotFoundException
        from airflow.models.connection import Connection
    except ImportError as exc:
        raise ValueError(f"--conn-id reads an Airflow connection, and Airflow is not installed ({exc}): "
                         "pip install 'airflow-elastic-gpu[airflow]', or give --broker-url") from None
    for name, level in (("airflow.models", logging.ERROR), ("alembic", logging.WARNING)):  # stdlib loggers
        logging.getLogger(name).setLevel(level)
    variable = f"AIRFLOW_CONN_{conn_id.upper()}"
    try:
        # not the hook's own read: outside a task or server it skips the metadata DB
        return Connection.get_connection_from_secrets(conn_id)
    except AirflowNotFoundException:
        if os.environ.get(variable):
            raise ValueError(f"${variable} is set but Airflow cannot read connection {conn_id!r} from it: "
                             "it must be a connection URI or JSON such as "
                             '{"conn_type": "elastic_gpu", "extra": {"url": "postgresql+psycopg://...", '
                             '"pool": "default"}} (check its quoting)') from None
        raise ValueError(f"no Airflow connection {conn_id!r} (define it in the Airflow UI, with "
                         f"'airflow connections add', or as ${variable}; the "
                         "metadata DB is the one of this shell's AIRFLOW_HOME)") from None
    except Exception as exc:  # noqa: BLE001 - a secrets backend that denies it or is down: one line
        raise ValueError(f"cannot read Airflow connection {conn_id!r}: {exc}") from None


def first_line(exc: DBAPIError) -> str:
    """The first line (at most 300 characters) of what the database driver said in ``exc``: one line
    instead of SQLAlchemy's statement, parameters and link."""
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def database_error(exc: DatabaseError, url: str, conn_id: str | None) -> str:
    """The one line that says why the broker database ``url`` (from connection ``conn_id``, else the
    CLI's option or settings) failed with ``exc``, and what to check (the password masked)."""
    first = first_line(exc)
    where = (f"the Airflow connection {conn_id!r}" if conn_id else
             "--broker-url, $AIRFLOW_ELASTIC_GPU_BROKER_URL or [elastic_gpu] broker_url")
    sqlite = url.startswith("sqlite")  # a file, or a file: URI
    if isinstance(exc, OperationalError) and "locked" in first:  # SQLite's write lock, held past its timeout
        said, check = "the broker database is busy", "that no process holds it for minutes, then try again; and the URL"
    elif isinstance(exc, OperationalError) and (sqlite or "space left" in first or "disk" in first.lower()):
        said, check = "cannot use the broker database", "that its disk has room and its files may be written, and the URL"
    elif isinstance(exc, OperationalError):  # the database cannot be reached
        said, check = "cannot reach the broker database", "that the server runs and the URL"
    else:  # it answers, but is no broker database (a SQLite URL naming some other file)
        said, check = "cannot use the broker database", "that the URL"
    return f"{said} {mask_url(url)}: {first}. Check {check} ({where}) is right."


class RetryNotice(logging.Handler):
    """Says once, on stderr, that the broker's database does not answer and calls are being retried:
    a command sat silent for up to ``deadline_s`` before its error.

    :param notes: the console it prints on (stderr).
    :param deadline_s: how long the calls are retried (seconds).
    """

    def __init__(self, notes: Console, deadline_s: float) -> None:
        super().__init__(logging.INFO)
        self.notes, self.deadline_s, self.said = notes, deadline_s, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.said and record.args and record.args[0] == "connection":
            self.said = True
            self.notes.print(f"the broker database does not answer; retrying for up to {self.deadline_s:g} s",
                        style="dim", markup=False, highlight=False)
