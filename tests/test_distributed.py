"""The distributed deployment, scaled down: PostgreSQL, CeleryExecutor, two workers, two triggerers.

Runs ``python -m airflow_elastic_gpu.demo_distributed`` as a user would (a subprocess, its own
databases dropped at the end) and reads the figures it writes. Needs the PostgreSQL server of
the other tests and Redis at ``127.0.0.1:6379`` (``ELASTIC_GPU_TEST_REDIS_URL``); skipped
without them, except under CI (``CI=true``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import psutil
import pytest
from conftest import POSTGRES_URL, REPO
from sqlalchemy.engine import make_url

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
REDIS_URL = os.environ.get("ELASTIC_GPU_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _need(what: str, host: str | None, port: int | None) -> None:
    try:
        socket.create_connection((host or "127.0.0.1", port), timeout=3).close()
    except OSError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{what} at {host}:{port} is required in CI: {exc}")
        pytest.skip(f"{what} not reachable at {host}:{port}: {exc}")


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory) -> dict:
    """The figures of one scaled-down run (4 trainings), and where its Airflow home was."""
    pytest.importorskip("airflow.providers.celery", reason="pip install 'airflow-elastic-gpu[distributed]'")
    pg, redis = make_url(POSTGRES_URL), make_url(REDIS_URL)
    _need("PostgreSQL", pg.host, pg.port or 5432)
    _need("Redis", redis.host, redis.port or 6379)
    tmp = tmp_path_factory.mktemp("distributed")
    results = tmp / "distributed.json"
    run = subprocess.run(
        [sys.executable, "-m", "airflow_elastic_gpu.demo_distributed", "--jobs", "4", "--steps", "120",
         "--home", str(tmp / "home"), "--db-prefix", f"elastic_demo_test_{os.getpid()}",
         "--postgres-url", POSTGRES_URL, "--celery-broker", REDIS_URL, "--results", str(results),
         "--timeout-s", "600", "--drop-databases"],
        check=False, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1500)
    assert results.exists(), f"no figures written (exit {run.returncode}):\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    return {"rc": run.returncode, "out": run.stdout, "home": tmp / "home", **json.loads(results.read_text())}


def test_every_training_of_the_distributed_run_succeeds(distributed_run):
    assert distributed_run["dag_run_state"] == "success", distributed_run["out"][-6000:]
    assert [t["status"] for t in distributed_run["trainings"]] == ["succeeded"] * 4
    assert distributed_run["rc"] == 0


def test_both_celery_workers_ran_trainings(distributed_run):
    ran = {w for t in distributed_run["trainings"] for w in t["workers"]}
    assert ran == {"worker-1", "worker-2"}


def test_a_killed_triggerers_trainings_are_taken_over_by_the_other(distributed_run):
    kill = distributed_run["killed_triggerer"]
    assert kill is not None and kill["held"], "no triggerer held a training when one was killed"
    assert sorted(int(i) for i in kill["taken_over_after_s"]) == sorted(kill["held"])
    for t in distributed_run["trainings"]:
        if t["map_index"] in kill["held"]:
            assert t["triggerers"][-2:] == [kill["victim"], kill["survivor"]]


def test_the_broker_never_held_a_gpu_twice_during_the_run(distributed_run):
    assert distributed_run["invariant_checks"] > 10
    assert sum(distributed_run["invariant_violations"].values()) == 0, distributed_run["invariant_violations"]


def test_no_process_of_the_run_outlives_it(distributed_run):
    home = str(distributed_run["home"])
    left = []
    for p in psutil.process_iter():
        try:
            if any(v.startswith(home) for v in p.environ().values()):
                left.append((p.pid, p.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert left == []
