"""The pool page's polls read along indexes, so their cost does not grow with the broker's history
(jobs and events are never deleted): SQLite's plan of every SELECT one poll makes has no sort of a
whole table and no scan of every event. Before migration 0016 the snapshot sorted every ended job of
the pool to find the latest 100 (76 ms with 2,000 ended jobs, 440 ms with 100,000, every 2 s per
viewer), and a quiet pool's page walked back through every newer event of the other pools."""

from __future__ import annotations

import sqlite3

import pytest
from conftest import RESIZE_AT_ONCE, FakeClock
from fastapi.testclient import TestClient
from sqlalchemy import event

from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec


@pytest.fixture
def broker(tmp_path):
    clock = FakeClock()
    b = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", clock=clock)
    b.register_node("n0", 4)
    b.register_node("q0", 1, pool="quiet")
    b.configure_pool(policy_params=RESIZE_AT_ONCE)
    for i in range(3):  # ended jobs, and events of both pools
        job = b.submit(JobSpec(f"done-{i}", "t", 1, 2, total_steps=100))
        b.ack(job.id, 1)
        clock.advance(5)
        b.finish(job.id)
    b.submit(JobSpec("quiet-job", "t", 1, 1, total_steps=100, pool="quiet"))
    yield b
    b.engine.dispose()


def plans(b: GpuBroker, paths: list[str]) -> list[tuple[str, str]]:
    """``(statement, plan)`` of every SELECT the requests to ``paths`` make."""
    seen: list[tuple[str, object]] = []

    def record(conn, cursor, statement, params, context, executemany) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, params))

    client = TestClient(create_app(b))
    event.listen(b.engine, "before_cursor_execute", record)
    try:
        for path in paths:
            assert client.get(path).status_code == 200, path
    finally:
        event.remove(b.engine, "before_cursor_execute", record)
    with sqlite3.connect(b.engine.url.database) as con:
        return [(s, " | ".join(r[3] for r in con.execute("EXPLAIN QUERY PLAN " + s, p))) for s, p in seen]


def test_the_snapshot_and_the_jobs_list_sort_no_table(broker):
    read = plans(broker, ["/api/v1/pools/default/snapshot", "/api/v1/jobs?order=desc&limit=10",
                          "/api/v1/jobs?pool=default&limit=10"])
    assert any("end_s" in s for s, _ in read), "the snapshot's latest ended jobs were read"
    sorted_all = [(s, p) for s, p in read if "FROM job" in s and "TEMP B-TREE FOR ORDER BY" in p]
    assert not sorted_all, sorted_all


def test_a_quiet_pools_page_reads_its_own_events_only(broker):
    read = plans(broker, ["/api/v1/pools/quiet/snapshot?events=100", "/api/v1/pools/quiet/timeline"])
    of_pool = [(s, p) for s, p in read if "FROM event" in s and "event.pool = ?" in s]
    assert of_pool, "the pool's events were read"
    # "SCAN event", or a walk down the primary key from its top: either reads every newer event
    assert all("USING INDEX ix_event_pool_id" in p or "USING COVERING INDEX ix_event_pool_id" in p
               for _, p in of_pool), of_pool
