"""The broker's clock: the PostgreSQL server's, so that every process on a broker counts time alike.

Heartbeats are stamped, and silent jobs reaped, by whichever process makes the call: the API
server, a triggerer, a worker's task, the CLI, each on its own machine. A reaper whose clock runs
ahead of the stamping process's by more than the lease's fence margin (``max(1 s, lease / 10)``,
:func:`~airflow_elastic_gpu.sidecar.protocol.fence_periods`) would free a job's GPUs before its
launcher has fenced the trainer. On PostgreSQL every process therefore counts on the database
server's clock: it reads it (``clock_timestamp()``, at the midpoint of the round trip) and
advances it with its own monotonic clock, which a step of the machine's wall clock (an NTP
correction, a mis-set clock) does not move and a suspend of the machine does (``CLOCK_BOOTTIME``); it reads it again every :data:`RESYNC_S`, which bounds
both the drift of the machines' monotonic clocks (tens of ppm: a second a day) and the
disagreement a step of the server's own clock leaves between processes that read it before and
after. SQLite is a local file: its processes share one machine's clock, and the broker uses it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

SKEW_WARNING_S = 1.0
"""A machine clock further than this from the database server's is logged (seconds)."""

RESYNC_S = 300.0
"""How often a process reads the database server's clock again (seconds)."""

RETRY_S = 10.0
"""After a failed re-read (the server unreachable), how long the last reading serves before the next try."""

_SERVER_NOW = text("SELECT extract(epoch FROM clock_timestamp())")


def boot_monotonic() -> float:
    """A monotonic clock that counts the time the machine was suspended (Linux ``CLOCK_BOOTTIME``;
    elsewhere ``time.monotonic``). ``CLOCK_MONOTONIC`` stands still in a suspend: a process resumed
    after X seconds stamped heartbeats X seconds in the past until its next re-read, and a reaper
    with a right clock then freed the job's GPUs before its launcher had fenced the trainer."""
    return _clock_gettime(_BOOTTIME) if _BOOTTIME is not None else _monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
_clock_gettime, _monotonic = getattr(time, "clock_gettime", None), time.monotonic
_CLOCKS: weakref.WeakKeyDictionary[Engine, DatabaseClock] = weakref.WeakKeyDictionary()


class DatabaseClock:
    """The database server's time (epoch seconds), read every ``resync_s`` and advanced by
    ``monotonic`` in between.

    :param engine: a PostgreSQL engine.
    :param monotonic: the local monotonic clock (seconds; default :func:`boot_monotonic`).
    :param wall: the local wall clock (epoch seconds; default ``time.time``), only to report the
        skew (``skew_s``).
    :param resync_s: how often the server's clock is read again (seconds; default :data:`RESYNC_S`),
        in a background thread (:meth:`wait_reread`). A failed re-read is logged and tried again
        :data:`RETRY_S` later; the last reading serves meanwhile.
    :raises sqlalchemy.exc.DBAPIError: the server cannot be reached for the first reading.
    """

    def __init__(self, engine: Engine, *, monotonic: Callable[[], float] | None = None,
                 wall: Callable[[], float] | None = None, resync_s: float = RESYNC_S) -> None:
        self._engine = engine
        self._monotonic = monotonic or boot_monotonic
        self._wall = wall or time.time
        self._resync_s = resync_s
        self._reading = threading.Lock()
        self._reading_since = self._stuck_warned = -float("inf")  # the re-read in progress, its warning
        self._read()

    def _read(self) -> None:
        with self._engine.connect() as conn:
            sent = self._monotonic()
            server = float(conn.execute(_SERVER_NOW).scalar_one())
            received = self._monotonic()
        self._base = server - (sent + received) / 2  # the server's time at monotonic 0
        self._next_read = received + self._resync_s
        self.skew_s = self._wall() - (self._base + received)
        """How far this machine's wall clock is ahead of the server's (seconds; negative: behind)."""

    def __call__(self) -> float:
        now = self._monotonic()
        # a re-read is due: a thread of its own makes it, on a pooled connection it may have to
        # wait for (every one may be held by callers inside their transactions, as this one may
        # be); every caller goes on with the last reading meanwhile, and if the read fails
        if now >= self._next_read:
            if self._reading.acquire(blocking=False):
                self._next_read, self._reading_since = now + RETRY_S, now
                try:
                    threading.Thread(target=self._reread, name="broker-clock-resync", daemon=True).start()
                except RuntimeError as exc:  # no thread to be had (a thread limit, interpreter shutdown)
                    self._reading.release()
                    log.warning("could not start the re-read of the broker database server's clock (%s); the "
                                "last reading serves", exc)
            elif now - self._reading_since > self._resync_s and now >= self._stuck_warned + self._resync_s:
                self._stuck_warned = now  # e.g. a connection that never answers: said once a period
                log.warning("the re-read of the broker database server's clock started %.0fs ago has not "
                            "ended; the last reading serves", now - self._reading_since)
        return self._base + now

    def _reread(self) -> None:
        try:
            self._read()
        except Exception as exc:  # a thread of its own: the server unreachable, the
            # connection pool exhausted, anything else is logged the same, and the last reading serves
            log.warning("could not read the broker database server's clock again (%s); the last "
                        "reading serves", type(exc).__name__, exc_info=not isinstance(exc, SQLAlchemyError))
        finally:
            self._reading.release()

    def wait_reread(self, timeout_s: float = 60.0) -> bool:
        """Wait for a re-read in progress to end (it is made in the background); False on timeout."""
        if not self._reading.acquire(timeout=timeout_s):
            return False
        self._reading.release()
        return True


class LazyBrokerClock:
    """:func:`broker_clock` of ``engine``, looked up on the first call (inside the caller's
    retried transaction), so that making a broker client does no I/O: an agent started while the
    database is down retries like any call instead of failing at start."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._clock: Callable[[], float] | None = None

    def prepare(self) -> None:
        """Make the first reading now, if not made yet: the broker calls this before opening a
        transaction, so that the reading's connection is not a second one taken while the caller
        holds one (all of the pool's may be held so).

        :raises sqlalchemy.exc.DBAPIError: the server cannot be reached (retried as the call is).
        """
        if self._clock is None:
            self._clock = broker_clock(self._engine)

    def __call__(self) -> float:
        self.prepare()
        assert self._clock is not None
        return self._clock()


def broker_clock(engine: Engine) -> Callable[[], float]:
    """The clock a broker on ``engine`` counts time on: a :class:`DatabaseClock` on PostgreSQL
    (one per engine, made on first use; a skew over :data:`SKEW_WARNING_S` is logged), else the
    machine's wall clock (``time.time``).

    :raises sqlalchemy.exc.DBAPIError: the PostgreSQL server cannot be reached.
    """
    if engine.dialect.name != "postgresql":
        return time.time
    clock = _CLOCKS.get(engine)
    if clock is None:
        clock = _CLOCKS.setdefault(engine, DatabaseClock(engine))
        if abs(clock.skew_s) > SKEW_WARNING_S:
            log.warning("this machine's clock is %+.1fs off the broker database server's; the broker counts "
                        "time on the server's clock (heartbeats, leases, rebalance intervals)", clock.skew_s)
    return clock
