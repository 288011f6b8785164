"""A resize counts once the trainer runs it: the demo's summary, the API's timeline and the jobs
table agree, even when a published generation is replaced before its ack."""

from __future__ import annotations

import io

import pytest
from conftest import RESIZE_AT_ONCE
from rich.console import Console

from airflow_elastic_gpu.broker.api_models import timeline
from airflow_elastic_gpu.broker.history import applied_resizes
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.demo import print_new_events, summary_table


@pytest.fixture
def resized(clock, tmp_path) -> tuple[GpuBroker, str]:
    """Job "a" runs on 4 GPUs (generation 1, acked); a shrink to 3 is published (2) and replaced by a
    grow back to 4 (3) before any ack; 3 is acked (a restart on 4 GPUs); then a shrink to 3 (4), acked.
    Published: 3 resizes (2 down, 1 up); run by the trainer: 2 (one to as many GPUs, one down)."""
    b = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", clock=clock)
    b.register_node("n0", 4)
    b.configure_pool(policy_params=RESIZE_AT_ONCE)
    a = b.submit(JobSpec("a", "x", 1, 4, total_steps=1000))
    assert b.ack(a.id, 1)
    clock.advance(10)
    newcomer = b.submit(JobSpec("b", "x", 1, 1, total_steps=1000))  # a must shrink: generation 2
    clock.advance(5)
    b.cancel(newcomer.id)  # before a acks 2: a grows back, generation 3 replaces 2
    b.rebalance()
    assert b.job(a.id).target_generation == 3 and b.ack(a.id, 3)
    clock.advance(10)
    b.submit(JobSpec("c", "x", 1, 1, total_steps=1000))  # generation 4: 3 GPUs, acked
    clock.advance(5)
    assert b.job(a.id).target_generation == 4 and b.ack(a.id, 4)
    yield b, a.id
    b.engine.dispose()


def test_only_acked_generations_count_as_resizes_as_in_the_jobs_table(resized):
    broker, a = resized
    published = [e for e in broker.events(job_id=a) if e.kind == "resize"]
    applied = applied_resizes(broker.events(job_id=a))
    assert len(published) == 3
    assert [(r.generation, r.from_gpus, r.to_gpus) for r in applied] == [(3, 4, 4), (4, 4, 3)]
    assert len(applied) == broker.job(a).num_resizes == 2
    assert applied[1].shrank and not applied[0].grew and not applied[0].shrank


def test_the_demo_summary_counts_resizes_as_the_api_timeline_and_the_jobs_table(resized):
    broker, a = resized
    table, grew, shrank = summary_table(broker, [broker.job(a)], "summary")
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    [row] = [line for line in out.getvalue().splitlines() if "│ a " in line]
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[5] == "4 -> 4 -> 3"  # GPUs over time: what the trainer ran on
    assert cells[6:9] == ["2", "0", "1"]  # resizes, up, down
    assert (grew, shrank) == (0, 1)
    on_timeline = [r for r in timeline(broker, "default").resizes if r.job_id == a]
    assert len(on_timeline) == broker.job(a).num_resizes == 2


def test_timeline_resizes_sit_where_the_trainer_ran_them_with_the_decisions_reason(resized):
    broker, a = resized
    acks = {e.data["generation"]: e.time_s for e in broker.events(job_id=a) if e.kind == "ack"}
    reasons = {e.data["generation"]: e.message for e in broker.events(job_id=a) if e.kind == "resize"}
    shown = [r for r in timeline(broker, "default").resizes if r.job_id == a]
    assert [r.time_s for r in shown] == [acks[3], acks[4]]  # at the start of the new bar, not before
    assert [r.message for r in shown] == [reasons[3], reasons[4]]


def test_the_demo_prints_a_line_per_event_when_not_on_a_terminal(resized):
    broker, _ = resized
    out = io.StringIO()
    last = print_new_events(broker, Console(file=out, width=1000))
    lines = out.getvalue().splitlines()
    events = broker.events()
    assert len(lines) == len(events) and last == events[-1].id
    assert all(e.kind in line and e.message in line for e, line in zip(events, lines, strict=True))
    assert print_new_events(broker, Console(file=out, width=1000), last) == last  # nothing new: nothing printed
    assert out.getvalue().splitlines() == lines


def test_demo_stop_reaches_children_that_left_the_process_group(tmp_path, monkeypatch):
    """``make demo-stop`` signals every process of the demo's session: Airflow's scheduler moves some
    children (the log server, executor workers) to process groups of their own, which a killpg of
    the session leader's group missed."""
    import os
    import subprocess
    import sys
    import time

    from airflow_elastic_gpu import demo

    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", script, "airflow standalone (stand-in)"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    time.sleep(0.3)  # the child has left the leader's process group
    assert os.getpgid(child) != os.getpgid(leader.pid)
    assert {leader.pid, child} <= set(demo.session_members(leader.pid))
    pid_file = tmp_path / "standalone.pid"
    pid_file.write_text(str(leader.pid))
    monkeypatch.setattr(demo, "PID_FILE", pid_file)
    demo.stop()
    leader.wait(5)
    assert demo.session_members(leader.pid) == [] and not pid_file.exists()


def test_demo_stop_leaves_a_stale_pid_files_process_alone(tmp_path, monkeypatch):
    """After a reboot or a crash the pid file names a pid that may be anyone's session now: the
    demo's processes are Airflow's, and a session without one is not signalled."""
    import subprocess
    import sys

    from airflow_elastic_gpu import demo

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    pid_file = tmp_path / "standalone.pid"
    pid_file.write_text(str(other.pid))
    monkeypatch.setattr(demo, "PID_FILE", pid_file)
    try:
        demo.stop()
        assert other.poll() is None and not pid_file.exists()
    finally:
        other.kill()
        other.wait(5)


def test_the_demo_environment_drops_the_callers_airflow_settings(monkeypatch):
    from airflow_elastic_gpu import demo
    from airflow_elastic_gpu.config import default_broker_url

    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__BROKER_URL", "postgresql+psycopg://u:p@prod/broker")
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", "elastic-gpu://?broker_url=postgresql%3A%2F%2Fprod")
    monkeypatch.setenv("AIRFLOW_CONFIG", "/etc/airflow/airflow.cfg")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://prod/airflow")
    env = demo.demo_env()
    assert not any(k in env for k in ("AIRFLOW__ELASTIC_GPU__BROKER_URL", "AIRFLOW_CONN_ELASTIC_GPU_DEFAULT",
                                      "AIRFLOW_CONFIG", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"))
    assert default_broker_url(env) == f"sqlite:///{demo.DEMO / 'airflow' / 'elastic_gpu_broker.db'}"
