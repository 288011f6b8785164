"""Shared fixtures: a broker on SQLite and on PostgreSQL, a fake clock, the repository paths."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from airflow_elastic_gpu.broker.service import GpuBroker

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_digits.py"
POSTGRES_URL = os.environ.get(
    "ELASTIC_GPU_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


#: pool policy parameters of a pool that resizes at once: no hysteresis, no minimum interval between
#: resizes, no hold for a job's restart overhead
RESIZE_AT_ONCE = {"hysteresis": 0.0, "min_resize_interval_s": 0.0, "max_restart_hold_s": 0.0}

class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped at the end.

    Skipped when no server answers, except under CI (``CI=true``), where it fails.
    """
    admin = create_engine(make_url(POSTGRES_URL), isolation_level="AUTOCOMMIT")
    name = f"aeg_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any connection failure
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL at {POSTGRES_URL} is required in CI: {exc}")
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}: {exc}")
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n AND pid <> pg_backend_pid()"
        ), {"n": name})
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def _reset_postgres(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def broker_url(request, tmp_path) -> str:
    """A broker DB URL, empty: a SQLite file, or a clean schema in the test PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'broker.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def postgres_url(postgres_server_url) -> str:
    """The test PostgreSQL database, its schema emptied."""
    _reset_postgres(postgres_server_url)
    return postgres_server_url


@pytest.fixture
def broker(broker_url, clock) -> Iterator[GpuBroker]:
    b = GpuBroker(broker_url, clock=clock)
    yield b
    b.engine.dispose()


@pytest.fixture
def pool(broker: GpuBroker) -> GpuBroker:
    """:func:`broker` with one node of 4 GPUs and a pool that resizes at once (no hysteresis, no
    minimum interval between resizes, no hold for the restart overhead)."""
    broker.register_node("n0", 4)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    return broker


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def _host_claim_of_the_test(tmp_path, monkeypatch):
    """Each test's own host claim directory (``[elastic_gpu] host_claim_dir``): a test that fakes
    a host's real GPUs never records a claim on the machine running the tests, nor sees another's."""
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_HOST_CLAIM_DIR", str(tmp_path / "host-claim"))


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_capture():
    """A command that imports Airflow (``nodes kube-sync``) lets Airflow configure logging, whose
    handlers keep the ``sys.stderr`` of that moment: a test's capture, closed after it. Such a
    handler is dropped after the test, so that a later test's log lines (the broker's migrations)
    do not print "--- Logging error ---" tracebacks into that test's captured output."""
    yield
    for logger in [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]:
        for handler in list(logger.handlers):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


@pytest.fixture
def worker_env(tmp_path, monkeypatch) -> Iterator[tuple[GpuBroker, Any, Path]]:
    """A broker and job directory for operators run in this process (as a worker runs them), and a
    stand-in trainer that prints JSON progress lines (``trainer.py x STEPS``, 20 steps/s)."""
    from test_sidecar import TRAINER

    from airflow_elastic_gpu.backends.local import LocalBackend

    url = f"sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_WORK_DIR", str(tmp_path / "jobs"))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    broker = GpuBroker(url)
    backend = LocalBackend(tmp_path / "jobs", broker)
    yield broker, backend, trainer
    for job in broker.jobs():
        backend.stop(job.id, timeout_s=10)
    broker.engine.dispose()


def local_backend(tmp_path: Path, *, gpus: int, grace_s: float, stop_timeout_s: float) -> Iterator[tuple[GpuBroker, Any]]:
    """For a fixture to ``yield from``: a broker (SQLite) whose node ``localhost`` has ``gpus`` GPUs and
    a local backend (job directories under ``jobs/``, polls every 0.2 s, stops wait ``grace_s``);
    every job's processes are stopped afterwards (each waited for ``stop_timeout_s``)."""
    from airflow_elastic_gpu.backends.local import LocalBackend

    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}")
    broker.register_node("localhost", gpus)
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=grace_s)
    yield broker, backend
    for job in broker.jobs():
        backend.stop(job.id, timeout_s=stop_timeout_s)
    broker.engine.dispose()
