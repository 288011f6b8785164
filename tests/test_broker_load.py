"""Concurrency on PostgreSQL: many clients, randomized operations, an independent invariant checker.

The short version of ``benchmarks/broker_load.py`` (which runs 64 clients x 10,000 operations).
"""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, _reset_postgres

sys.path.insert(0, str(REPO / "benchmarks"))
import private_postgres
from broker_load import CHECKS, check, run_load


@pytest.mark.postgres
def test_concurrent_clients_never_break_an_invariant(postgres_server_url):
    _reset_postgres(postgres_server_url)
    result = run_load(postgres_server_url, clients=16, ops=800, seed=1, nodes=2, gpus_per_node=4)
    assert result["operations"] == 800
    assert result["invariant_checks"] >= 2
    assert result["violations_by_kind"] == {name: 0 for name in CHECKS}
    assert set(result["latency_ms"]) >= {"submit", "progress", "ack", "rebalance"}


def test_the_checker_sees_a_planted_violation(tmp_path):
    """The checker is not vacuous: an ended job left holding a GPU (written behind the broker's back) is reported."""
    from sqlalchemy import text

    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.broker.types import JobSpec

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("n0", 1)
    a = broker.submit(JobSpec("a", "x", 1, 1))
    b = broker.submit(JobSpec("b", "x", 1, 1))
    assert sum(check(broker.engine, "default").values()) == 0
    with broker.engine.begin() as conn:  # bypass the broker: end job a but leave it holding its GPU
        gpu = conn.execute(text("SELECT gpu_id FROM gpu_target WHERE job_id = :a"), {"a": a.id}).scalar_one()
        conn.execute(text("DELETE FROM gpu_target WHERE job_id = :a"), {"a": a.id})
        conn.execute(text("UPDATE job SET status = 'failed' WHERE id = :a"), {"a": a.id})
        conn.execute(text("INSERT INTO gpu_in_use (gpu_id, job_id, generation) VALUES (:g, :a, 1)"),
                     {"g": gpu, "a": a.id})
    found = check(broker.engine, "default")
    assert found["ended job holds a GPU"] == 1
    assert found["gpu in two jobs' in-use sets"] == 0
    assert broker.job(b.id).in_use_gpus == ()
    with broker.engine.begin() as conn:  # a cancelled job may hold it while its trainer stops, not a lease later
        conn.execute(text("UPDATE job SET status = 'cancelled', last_heartbeat_s = last_heartbeat_s - 1000 "
                          "WHERE id = :a"), {"a": a.id})
    found = check(broker.engine, "default")
    assert found["ended job holds a GPU"] == 0 and found["cancelled job holds a GPU past its lease"] == 1


@pytest.mark.skipif(not private_postgres.available(), reason="initdb/pg_ctl (PostgreSQL server) not installed")
def test_clients_ride_out_a_real_server_restart():
    """A private PostgreSQL server is restarted (pg_ctl restart -m fast) under load: every client
    finishes its calls (connection refused / shutting down / starting up are retried), nothing is
    double-booked, and the retries are counted."""
    with private_postgres.PrivatePostgres() as pg:
        result = run_load(pg.url, clients=8, ops=1200, seed=2, nodes=2, gpus_per_node=4, processes=2,
                          restart=pg.restart, restart_after_s=1.5)
    assert len(result["server_restarts"]) == 1, "the server was not restarted during the run"
    assert result["client_failures"] == []
    assert result["operations"] == 1200
    assert result["violations_by_kind"] == {name: 0 for name in CHECKS}
    assert result["retried_transactions"] > 0
