"""The broker's clock on PostgreSQL is the database server's: a process on a machine whose clock
runs ahead neither reaps jobs that other processes heartbeat nor stamps times from the future."""

from __future__ import annotations

import logging
import time
import types

import pytest
from sqlalchemy import text

from airflow_elastic_gpu.broker import clock as clock_module
from airflow_elastic_gpu.broker.clock import DatabaseClock, broker_clock
from airflow_elastic_gpu.broker.db import create_broker_engine
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.states import JobStatus

pytestmark = pytest.mark.postgres
HOUR = 3600.0


def server_now(engine) -> float:
    with engine.connect() as conn:
        return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())


def test_the_database_clock_reads_the_server_and_advances_on_the_monotonic_clock(postgres_url):
    engine = create_broker_engine(postgres_url)
    ticks = [100.0]
    clock = DatabaseClock(engine, monotonic=lambda: ticks[0], wall=lambda: time.time() + HOUR)
    start = clock()
    assert abs(start - server_now(engine)) < 1.0
    assert clock.skew_s == pytest.approx(HOUR, abs=1.0)  # this "machine" is an hour ahead
    ticks[0] += 12.5  # only the monotonic clock moves it: a step of the wall clock does not
    assert clock() == pytest.approx(start + 12.5)
    engine.dispose()


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux's CLOCK_BOOTTIME")
def test_the_database_clock_advances_through_a_suspend_of_the_machine(postgres_url):
    """Its default monotonic clock counts the time the machine was suspended: on ``time.monotonic``
    a process resumed after X s stamped heartbeats X s in the past (until its next re-read), and a
    reaper on a right clock freed the job's GPUs before its launcher had fenced the trainer."""
    engine = create_broker_engine(postgres_url)
    clock = DatabaseClock(engine)
    assert clock._monotonic is clock_module.boot_monotonic
    assert clock_module.boot_monotonic() == pytest.approx(time.clock_gettime(time.CLOCK_BOOTTIME), abs=0.05)
    assert abs(clock() - server_now(engine)) < 1.0
    engine.dispose()


def test_the_database_clock_reads_the_server_again_every_resync_period(postgres_url, caplog):
    """Machines' monotonic clocks drift apart (and the server's clock may be stepped): a process
    that read the server once would drift off the others for good; the re-read bounds it."""
    engine = create_broker_engine(postgres_url)
    ticks = [100.0]
    clock = DatabaseClock(engine, monotonic=lambda: ticks[0], resync_s=300.0)
    start = clock()
    ticks[0] += 299.0  # this machine's monotonic clock ran 299 s while the server's did not
    assert clock() == pytest.approx(start + 299.0)
    ticks[0] += 2.0  # past the resync period: the server's time again, not 301 s ahead of it
    clock()  # starts the re-read, in the background
    assert clock.wait_reread(30)
    assert abs(clock() - server_now(engine)) < 1.0
    # the server unreachable at a re-read: logged, the last reading serves, tried again later
    clock._engine = create_broker_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    resynced = clock()
    ticks[0] += 301.0
    with caplog.at_level(logging.WARNING, logger="airflow_elastic_gpu.broker.clock"):
        assert clock() == pytest.approx(resynced + 301.0, abs=0.5)
        assert clock.wait_reread(30)
    assert "could not read the broker database server's clock again" in caplog.text
    assert clock._next_read == pytest.approx(ticks[0] + clock_module.RETRY_S)
    clock._engine.dispose()
    engine.dispose()


def test_a_due_re_read_never_keeps_the_caller_waiting_for_a_connection(postgres_url):
    """Every pooled connection may be held by callers inside their transactions, each of which
    reads the clock: the re-read waits for one in the background, the callers go on."""
    import threading

    engine = create_broker_engine(postgres_url)
    ticks = [100.0]
    clock = DatabaseClock(engine, monotonic=lambda: ticks[0], resync_s=300.0)
    start = clock()
    pool_free = threading.Event()

    class Exhausted:
        def connect(self):
            pool_free.wait(30)  # as QueuePool.connect waits for pool_timeout
            return engine.connect()

    clock._engine = Exhausted()
    ticks[0] += 301.0
    began = time.monotonic()
    assert clock() == pytest.approx(start + 301.0) and clock() == pytest.approx(start + 301.0)
    assert time.monotonic() - began < 1.0  # the caller was not held up by the pool
    pool_free.set()
    assert clock.wait_reread(30) and abs(clock() - server_now(engine)) < 1.0
    engine.dispose()


def test_a_re_read_that_cannot_start_or_never_ends_is_logged_and_the_last_reading_serves(
        postgres_url, monkeypatch, caplog):
    import threading

    engine = create_broker_engine(postgres_url)
    ticks = [100.0]
    clock = DatabaseClock(engine, monotonic=lambda: ticks[0], resync_s=300.0)
    start = clock()

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    ticks[0] += 301.0
    with caplog.at_level(logging.WARNING, logger="airflow_elastic_gpu.broker.clock"):
        monkeypatch.setattr(threading.Thread, "start", no_thread)
        assert clock() == pytest.approx(start + 301.0)
        monkeypatch.undo()
        assert "could not start the re-read" in caplog.text
        assert clock.wait_reread(0.1)  # nothing holds the re-read: the next one may start
        never = threading.Event()

        class Unanswered:  # a connection that never answers (a black-holed network)
            def connect(self):
                never.wait(30)
                raise RuntimeError("gave up")

        clock._engine = Unanswered()
        ticks[0] += 10.0  # the retry is due
        clock()
        ticks[0] += 301.0
        assert clock() == pytest.approx(start + 612.0)
        assert "has not ended; the last reading serves" in caplog.text
        never.set()
    engine.dispose()


def test_a_broker_on_postgresql_counts_on_the_server_clock_and_on_sqlite_on_the_machines(postgres_url, tmp_path):
    engine = create_broker_engine(postgres_url)
    assert isinstance(broker_clock(engine), DatabaseClock)
    assert broker_clock(engine) is broker_clock(engine)  # read once per engine
    sqlite = create_broker_engine(f"sqlite:///{tmp_path / 'b.db'}")
    assert broker_clock(sqlite) is time.time
    broker = GpuBroker(postgres_url)
    assert abs(broker.clock() - server_now(broker.engine)) < 1.0
    assert isinstance(broker.clock._clock, DatabaseClock)  # read on the first call, not when made
    # making a client does no I/O: an agent started while the database is down retries its calls
    GpuBroker("postgresql+psycopg://postgres@127.0.0.1:1/nowhere", migrate=False)
    engine.dispose()
    sqlite.dispose()


def test_the_first_reading_is_made_before_the_calls_transaction_not_on_a_second_connection(postgres_url):
    """A process whose connection pool has one connection (or whose every connection is held by
    calls in progress): the first reading of the server's clock takes none inside a transaction."""
    from sqlalchemy import create_engine

    GpuBroker(postgres_url).engine.dispose()  # the schema
    one = create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1),
                        pool_size=1, max_overflow=0, pool_timeout=2)
    broker = GpuBroker(one, migrate=False)
    broker.register_node("gpu-node-0", 2)
    job = broker.submit(JobSpec("train", "python train.py", 1, 2, total_steps=100))
    assert broker.job(job.id).status is JobStatus.RUNNING
    assert isinstance(broker.clock._clock, DatabaseClock)
    one.dispose()


def test_a_process_whose_machine_clock_runs_ahead_does_not_reap_a_job_that_others_heartbeat(
        postgres_url, monkeypatch, caplog):
    here = GpuBroker(create_broker_engine(postgres_url))
    here.register_node("gpu-node-0", 2)
    job = here.submit(JobSpec("train", "python train.py", 1, 2, total_steps=100))
    assert here.job(job.id).status is JobStatus.RUNNING
    here.heartbeat(job.id)
    # another process (a triggerer, the API server) on a machine whose clock is an hour ahead
    ahead = types.SimpleNamespace(time=lambda: time.time() + HOUR, monotonic=time.monotonic)
    monkeypatch.setattr(clock_module, "time", ahead)
    with caplog.at_level(logging.WARNING, logger="airflow_elastic_gpu.broker.clock"):
        there = GpuBroker(create_broker_engine(postgres_url))
        there.clock()
    assert "+3600" in caplog.text and "off the broker database server's" in caplog.text
    there.rebalance()
    assert there.job(job.id).status is JobStatus.RUNNING  # its heartbeat is seconds old, not an hour
    # what that process would have done on its own machine's clock (the broker's default before):
    # the hour it skipped reads as an outage, which gives the job a lease, and a lease later on
    # that clock (a minute from the heartbeat) the job is LOST
    on_machine_clock = GpuBroker(create_broker_engine(postgres_url), clock=ahead.time)
    on_machine_clock.rebalance()
    assert on_machine_clock.job(job.id).status is JobStatus.RUNNING
    on_machine_clock.clock = lambda: time.time() + HOUR + 61
    on_machine_clock.rebalance()
    assert on_machine_clock.job(job.id).status is JobStatus.LOST
    for b in (here, there, on_machine_clock):
        b.engine.dispose()
