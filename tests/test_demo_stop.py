"""``make demo-stop`` stops the demo's trainings too, and the demo's tasks call its own Airflow."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from test_sidecar import wait_for

from airflow_elastic_gpu import demo
from airflow_elastic_gpu.demo_processes import MARKER


def test_stop_ends_the_demos_job_processes_in_sessions_of_their_own(tmp_path, monkeypatch):
    """A job's agent, launcher and trainer run in sessions of their own, outside the demo's Airflow's:
    they trained on after ``make demo-stop`` and wrote to the broker database the next run deleted.
    Every process that carries the demo's marker is stopped; one of another checkout is not."""
    monkeypatch.setattr(demo, "PID_FILE", tmp_path / "standalone.pid")  # no Airflow of the demo runs
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, MARKER: demo.RUN_MARK}, start_new_session=True)
    other = subprocess.Popen(sleeper, env={**os.environ, MARKER: "make-demo:/another/checkout"},
                             start_new_session=True)
    try:
        environ = Path(f"/proc/{ours.pid}/environ")
        wait_for(lambda: demo.RUN_MARK in environ.read_bytes().decode(errors="replace"), 10, "the process to start")
        demo.stop()
        assert ours.wait(10) is not None
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_the_demos_tasks_call_the_demos_own_api_server_and_a_taken_port_is_refused(monkeypatch):
    """Airflow builds the tasks' execution API address from ``[api] base_url`` (port 8080 by default):
    with ``ELASTIC_GPU_DEMO_PORT`` set the tasks called whatever answered on 8080."""
    env = demo.demo_env()
    assert env["AIRFLOW__API__BASE_URL"] == f"http://localhost:{demo.PORT}"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"http://localhost:{demo.PORT}/execution/"
    assert env[MARKER] == demo.RUN_MARK
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert demo.port_taken(port)
    assert not demo.port_taken(port)


def test_the_distributed_demos_figures_skip_a_try_a_retry_replaced(tmp_path):
    """A retried training's first job keeps its key with ``@<job id>`` appended: reading the map
    index from it crashed the distributed demo's summary."""
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.broker.types import JobSpec
    from airflow_elastic_gpu.demo_distributed_report import (
        DAG_ID,
        TASK_ID,
        Observer,
        training_figures,
    )

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        broker.register_node("n0", 2)
        key = f"{DAG_ID}/{TASK_ID}/manual__1/0"
        first = broker.submit(JobSpec("train_0", "t", 1, 1, total_steps=10, key=key))
        broker.fail(first.id, "its worker was lost")
        retry = broker.submit(JobSpec("train_0", "t", 1, 1, total_steps=10, key=key))
        assert retry.id != first.id and broker.job(first.id).key.startswith(key + "@")
        figures = training_figures(broker, Observer(engine=broker.engine, run_id="manual__1", t0=0.0))
        assert [(f.map_index, f.failed_tries) for f in figures] == [(0, 1)]  # the failed try is told
    finally:
        broker.engine.dispose()


def test_the_distributed_demo_deletes_nothing_it_did_not_make_nor_before_its_server_answers(tmp_path, capsys):
    """``--home ~`` deleted ``~/airflow`` (DAGs, config); and a run whose PostgreSQL was away deleted
    the last run's logs before it failed, with a traceback."""
    from airflow_elastic_gpu import demo_distributed

    away = ["--postgres-url", "postgresql+psycopg://postgres@127.0.0.1:1/postgres", "--results",
            str(tmp_path / "r.json")]
    home = tmp_path / "home"
    (home / "airflow" / "dags").mkdir(parents=True)  # a user's own Airflow home
    try:
        demo_distributed.main(["--home", str(home), *away])
        raise AssertionError("a home the demo did not make was taken")
    except SystemExit as refused:
        assert "holds airflow that this demo did not make" in str(refused.code)
    assert (home / "airflow" / "dags").is_dir()
    (home / demo_distributed.HOME_MARKER).write_text("")  # a home of an earlier run: its files may go, later
    (home / "logs").mkdir()
    try:
        demo_distributed.main(["--home", str(home), *away])
        raise AssertionError("it ran without its server")
    except SystemExit as failed:
        assert "cannot make the demo's databases on postgresql+psycopg://postgres@127.0.0.1:1/postgres" in str(
            failed.code)
    assert (home / "airflow" / "dags").is_dir() and (home / "logs").is_dir()


def test_a_demo_pid_file_left_empty_and_a_port_that_is_no_port_are_said_without_a_traceback(tmp_path, monkeypatch):
    """An empty ``standalone.pid`` (a full disk as it was written) made ``make demo-stop`` and every
    later ``make demo`` fail with a ValueError traceback; ``ELASTIC_GPU_DEMO_PORT=abc`` one at import."""
    pid_file = tmp_path / "standalone.pid"
    pid_file.write_text("")
    monkeypatch.setattr(demo, "PID_FILE", pid_file)
    demo._stop_airflow()
    assert not pid_file.exists()
    run = subprocess.run([sys.executable, "-m", "airflow_elastic_gpu.demo"], capture_output=True, text=True,
                         env={**os.environ, "ELASTIC_GPU_DEMO_PORT": "abc"}, timeout=120, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "ELASTIC_GPU_DEMO_PORT must be a TCP port from 1 to 65535, got 'abc'" in run.stderr
