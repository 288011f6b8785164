"""The broker's plumbing: one short transaction per call, the pool and job locks, retries, events.

Every state change runs in one transaction (on PostgreSQL, one-statement calls such as a heartbeat
run in autocommit; a read of several statements, such as a job's view or a pool's snapshot, is one
REPEATABLE READ transaction). A rebalance, and a change to a pool's nodes or settings, holds the pool's lock
(PostgreSQL: ``SELECT ... FOR NO KEY UPDATE`` on the pool row, which leaves rows that reference the
pool free to be inserted); a job call locks its job row the same way first, and may then try the
pool's lock *without waiting* (``SKIP LOCKED``) to serve a due rebalance (:mod:`.rebalance`). In
SQLite every writer takes the database lock up front (``BEGIN IMMEDIATE``, see :mod:`.db`).
No deadlock: whoever waits for a lock holds at most the pool (a rebalance waiting for job rows) or
nothing (a node or pool change waiting for the pool), and nobody who holds a job row waits for the
pool. Serialization failures, deadlocks and lost connections are retried with back-off.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from airflow_elastic_gpu.broker import db
from airflow_elastic_gpu.broker.clock import LazyBrokerClock
from airflow_elastic_gpu.broker.models import GpuPool, Job
from airflow_elastic_gpu.broker.rows import Executor, add_event, unknown_pool
from airflow_elastic_gpu.broker.types import InvalidRequest, NotFound
from airflow_elastic_gpu.scheduling.policy import Policy
from airflow_elastic_gpu.states import EventKind

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRYABLE_PG_CODES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
# the server went away (restart, failover): the transaction was rolled back, so it is safe to redo
_RECONNECT_PG_CODES = {"57P01", "57P02", "57P03", "08000", "08001", "08003", "08004", "08006"}
# what drivers say when the server is restarting and the error carries no SQLSTATE
_RECONNECT_MESSAGES = (
    "connection refused", "the database system is shutting down", "the database system is starting up",
    "the database system is in recovery mode", "server closed the connection unexpectedly",
    "terminating connection", "connection is closed", "connection is lost", "consuming input failed",
    "could not receive data from server", "no connection to the server", "connection timeout expired",
    "ssl connection has been closed unexpectedly",
)
DEFAULT_RECONNECT_DEADLINE_S = 120.0


def transient_kind(exc: BaseException) -> str | None:
    """``"conflict"`` (serialization failure, deadlock, locked SQLite database: redo at once),
    ``"connection"`` (the server is unreachable, restarting or cut the connection: redo after
    back-off), or None (not transient: raise).
    """
    if isinstance(exc, IntegrityError):
        return None
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code in _RETRYABLE_PG_CODES or "database is locked" in str(exc):
        return "conflict"
    text = str(exc).lower()
    if (getattr(exc, "connection_invalidated", False) or code in _RECONNECT_PG_CODES
            or any(m in text for m in _RECONNECT_MESSAGES)):
        return "connection"
    return None


class BrokerBase:
    """Engine, sessions, locks and retries shared by the broker's parts (see :class:`GpuBroker`).

    :param url_or_engine: broker database URL or an engine (see :func:`db.create_broker_engine`);
        default :func:`airflow_elastic_gpu.config.default_broker_url`.
    :param policy: a policy object that overrides every pool's configured one
        (the simulator and tests use this); default: each pool's own setting.
    :param clock: returns the time in seconds (epoch); injected for tests and the simulator; default
        :func:`~airflow_elastic_gpu.broker.clock.broker_clock` (on PostgreSQL the server's clock, so
        that processes on machines whose clocks differ count leases alike).
    :param default_restart_overhead_s: assumed until a job's first resize is measured (seconds, >= 0).
    :param migrate: bring the schema to the latest revision if a version check finds it behind.
    :param reconnect_deadline_s: how long a call keeps retrying while the database is unreachable
        or restarting (seconds), before it raises.
    :param coalesce_s: under concurrent changes, at most one rebalance per this many seconds (on
        ``clock``) serves them (see :mod:`.rebalance`); a lone change is served at once.
    :raises InvalidRequest: a negative ``default_restart_overhead_s``.
    :raises ValueError: a malformed or unsupported URL.
    """

    def __init__(
        self,
        url_or_engine: str | Engine | None = None,
        *,
        policy: Policy | None = None,
        clock: Callable[[], float] | None = None,
        default_restart_overhead_s: float = 10.0,
        migrate: bool = True,
        coalesce_s: float = 0.25,
        reconnect_deadline_s: float = DEFAULT_RECONNECT_DEADLINE_S,
    ) -> None:
        if not coalesce_s >= 0:
            raise InvalidRequest(f"coalesce_s must be >= 0 seconds, got {coalesce_s}")
        if not default_restart_overhead_s >= 0:
            raise InvalidRequest(
                f"default_restart_overhead_s must be >= 0, got {default_restart_overhead_s}"
            )
        if isinstance(url_or_engine, Engine):
            self.engine = url_or_engine
        else:
            self.engine = db.broker_engine(url_or_engine or db.default_broker_url())
        self.policy_override = policy
        self.default_restart_overhead_s = default_restart_overhead_s
        self.coalesce_s = coalesce_s
        self.reconnect_deadline_s = reconnect_deadline_s
        self.rebalances = 0  # rebalances this client ran
        self.stale_rebalances = 0  # rebalances that published nothing: a job acked while they decided
        self.failed_rebalances = 0  # of them, those that raised inside a job call (logged, requests kept)
        self.retries = 0  # transactions redone after a serialization failure, deadlock or lost connection
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Calls that are one statement (a heartbeat, a target, a pool's row) run on PostgreSQL
        # without BEGIN/COMMIT round trips: each statement is atomic and sees its own snapshot;
        # reads of several statements are one REPEATABLE READ transaction (_read, _read_conn).
        # SQLite keeps its transactions.
        self._autocommit = (self.engine.execution_options(isolation_level="AUTOCOMMIT")
                        if self.engine.dialect.name == "postgresql" else self.engine)
        self._one_moment = self.engine.execution_options(isolation_level="REPEATABLE READ")
        self.clock: Callable[[], float] = clock or (
            LazyBrokerClock(self.engine) if self.engine.dialect.name == "postgresql" else time.time)
        if migrate:
            self._retrying(lambda: db.ensure_schema(self.engine))

    @property
    def url(self) -> str:
        """The database URL, password included (for processes this broker starts); never log it."""
        return self.engine.url.render_as_string(hide_password=False)

    # ------------------------------------------------------------------ transactions

    @contextmanager
    def _tx(self, pool: str | None = None, *, create_pool: bool = False) -> Iterator[Session]:
        """One transaction holding ``pool``'s lock (none when ``pool`` is None)."""
        with self._sessions.begin() as session:
            if pool is not None:
                self._lock(session, pool, create=create_pool)
            yield session

    def _lock(self, session: Session, pool: str, *, create: bool = False) -> GpuPool:
        """Lock ``pool``'s row (waiting for its holder) and return it; with ``create``, create it.

        :raises NotFound: unknown pool and not ``create``.
        """
        locking = (select(GpuPool).where(GpuPool.name == pool)
                   .with_for_update(key_share=True).execution_options(populate_existing=True))
        row = session.execute(locking).scalar_one_or_none()
        if row is None:
            if not create:
                raise unknown_pool(session, pool)
            # another transaction may create it at the same moment: one insert counts, and both lock it
            insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
            session.execute(insert(GpuPool).values(
                name=pool, created_s=self.clock(), last_rebalance_s=0.0, policy="adaptive",
                lease_s=60.0, rebalance_interval_s=10.0,
            ).on_conflict_do_nothing(index_elements=["name"]))
            row = session.execute(locking).scalar_one()
        return row

    def _retrying(self, fn: Callable[[], T], attempts: int = 8) -> T:
        """Run ``fn`` (one whole transaction), redoing it after a transient failure.

        * a serialization failure, a deadlock or a locked SQLite database: up to ``attempts`` times;
        * a lost or refused connection (the server restarts, fails over, or is starting up: the
          transaction was rolled back, so it is safe to redo): with back-off until
          :attr:`reconnect_deadline_s` seconds have passed.

        :raises OperationalError: anything else, or the same failure past those limits.
        """
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                if isinstance(self.clock, LazyBrokerClock):
                    self.clock.prepare()  # its first reading before fn's transaction, not inside it
                return fn()
            except (OperationalError, DBAPIError) as exc:
                kind = transient_kind(exc)
                if kind is None:
                    raise
                attempt += 1
                if kind == "connection":
                    if time.monotonic() - start >= self.reconnect_deadline_s:
                        raise
                elif attempt >= attempts:
                    raise
                self.retries += 1
                log.info("retrying a broker transaction after %s (%s)", kind, str(exc).splitlines()[0][:200])
                time.sleep(min(1.0, 0.01 * 2 ** min(attempt, 10)) * (1 + random.random()))

    def _read(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in a read-only session, retried like a transaction. Its statements see one
        moment: on PostgreSQL the session is a REPEATABLE READ transaction (READ COMMITTED, the
        default, gives each statement its own, so a job ending between two of them would be in
        both or neither); on SQLite a read is one transaction already. A read-only transaction
        at that level never fails to serialise."""
        def run() -> T:
            with self._sessions() as s:
                if self.engine.dialect.name == "postgresql":
                    s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
                return fn(s)

        return self._retrying(run)

    def _read_conn(self, fn: Callable[[Connection], T], *, one_statement: bool = False) -> T:
        """Run ``fn`` on a connection (plain SQL reads), retried like a transaction. Its statements
        see one moment, as :meth:`_read`'s do: on PostgreSQL a REPEATABLE READ transaction (a job
        view reads the job's row, then its GPUs: in separate moments a job that ended or was resized
        in between showed running with no GPUs, or one generation's number with another's GPUs).
        ``one_statement``: ``fn`` runs a single statement (a heartbeat's target, a pool's row),
        which is one moment by itself: autocommit, without BEGIN/COMMIT round trips."""
        def run() -> T:
            if one_statement or self.engine.dialect.name != "postgresql":
                with self._autocommit.connect() as conn:
                    return fn(conn)
            with self._one_moment.begin() as conn:
                return fn(conn)

        return self._retrying(run)

    def _job(self, session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id, populate_existing=True)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    def _event(self, s: Executor, pool: str, kind: EventKind, message: str, job_id: str | None = None,
               **data: Any) -> None:
        add_event(s, self.clock(), pool, kind, message, job_id, **data)
        log.info("[%s] %s%s", kind.value, f"job {job_id}: " if job_id else "", message)
