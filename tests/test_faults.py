"""Fault injection with real processes: every job ends finished correctly or failed with a clear
reason, and no GPU stays held by a dead job.

Kinds covered here: agent killed (restarted in time, or its lease expires), launcher killed in the
middle of a resize, triggerer restarted while a task is deferred, PostgreSQL connections killed
under load, a node drained under a running job. Elsewhere: trainer crash
(``test_sidecar.py::test_a_crashing_trainer_fails_the_job_with_its_last_log_lines``), worker killed
during ``execute`` and a task cleared and re-run
(``test_airflow.py::test_a_retried_task_reattaches_to_its_running_job_then_a_later_retry_replaces_it``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
from conftest import REPO, RESIZE_AT_ONCE, _reset_postgres
from sqlalchemy import create_engine, text
from test_sidecar import TRAINER, wait_for

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

sys.path.insert(0, str(REPO / "benchmarks"))
from broker_load import CHECKS, run_load


@pytest.fixture
def setup(tmp_path):
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = GpuBroker(url)
    broker.register_node("localhost", 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=5)
    started: list[str] = []

    def start(name: str, steps: int, min_gpus: int = 1, max_gpus: int = 2):
        job = broker.submit(JobSpec(name, f"{sys.executable} {trainer} x {steps}", min_gpus, max_gpus,
                                    total_steps=steps))
        broker.start(job.id, backend.start(job))
        started.append(job.id)
        return job, backend.handle(job.id)

    yield broker, backend, start
    for job_id in started:
        backend.stop(job_id, timeout_s=10)
    broker.engine.dispose()


def held_by(broker: GpuBroker, job_id: str) -> list:
    return [g.gpu for n in broker.snapshot().nodes for g in n.gpus if job_id in (g.in_use_by, g.target_of)]


def test_killed_agent_restarted_in_time_resumes_the_job(setup):
    broker, backend, start = setup
    job, handle = start("resumes", 160)
    wait_for(lambda: broker.job(job.id).steps_done >= 10, 60, "progress")
    os.kill(handle.agent_pid, signal.SIGKILL)
    wait_for(lambda: not protocol.pid_alive(handle.agent_pid), 10, "agent to die")
    assert protocol.pid_alive(handle.launcher_pid)  # the trainer runs on without its agent
    backend.start(job)  # e.g. the operator's retry, or a supervisor
    again = backend.handle(job.id)
    assert again.launcher_pid == handle.launcher_pid and again.agent_pid != handle.agent_pid
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 90, "job end")
    assert done.status is JobStatus.SUCCEEDED, done.reason
    assert done.steps_done == 160
    log = (handle.job_dir / protocol.LOG).read_text()
    assert log.count("generation 1: starting") == 1  # one trainer, never a second one
    assert held_by(broker, job.id) == []


def test_agent_and_launcher_killed_together_leave_no_second_trainer_when_the_job_is_started_again(setup):
    """Agent and launcher killed at once (an OOM kill of the slot): the trainer runs on in its own
    session. Starting the job again (a supervisor, a retry) kills it before the new launcher starts
    one on the same GPUs and checkpoint."""
    broker, backend, start = setup
    job, handle = start("relaunched", 100_000)
    wait_for(lambda: broker.job(job.id).steps_done >= 5, 60, "progress")
    old_trainer = int(protocol.read_json(handle.job_dir / protocol.STATUS)["pid"])
    for pid in (handle.agent_pid, handle.launcher_pid):
        os.kill(pid, signal.SIGKILL)
    # both gone (a SIGKILLed process takes a moment to exit; a live agent makes start a no-op)
    wait_for(lambda: not any(map(protocol.pid_alive, (handle.agent_pid, handle.launcher_pid))), 10,
             "the agent and the launcher to die")
    assert protocol.pid_alive(old_trainer)
    backend.start(job)
    assert not protocol.pid_alive(old_trainer)
    again = backend.handle(job.id)
    assert again.launcher_pid != handle.launcher_pid


def test_killed_agent_whose_lease_expires_is_lost_and_its_gpus_reclaimed(setup):
    broker, backend, start = setup
    broker.configure_pool(lease_s=2.0)
    job, handle = start("orphan", 10_000)
    wait_for(lambda: broker.job(job.id).in_use_gpus, 60, "job to run")
    os.kill(handle.agent_pid, signal.SIGKILL)
    time.sleep(2.5)
    broker.rebalance()
    lost = broker.job(job.id)
    assert lost.status is JobStatus.LOST
    assert "no heartbeat" in lost.reason and "reclaimed" in lost.reason
    assert held_by(broker, job.id) == []
    other, _ = start("next", 40)  # the GPUs are usable again at once
    assert len(broker.job(other.id).target_gpus) == 2
    backend.stop(job.id, timeout_s=10)  # the trigger's cleanup: no orphan trainer left
    assert not backend.is_running(job.id)
    done = wait_for(lambda: broker.job(other.id).status.terminal and broker.job(other.id), 60, "next job")
    assert done.status is JobStatus.SUCCEEDED


def test_launcher_killed_mid_resize_fails_the_job_and_frees_its_gpus(setup):
    broker, backend, start = setup
    a, handle = start("victim", 10_000)
    wait_for(lambda: len(broker.job(a.id).in_use_gpus) == 2, 60, "victim on 2 GPUs")
    b = broker.submit(JobSpec("newcomer", "sleep 1000", 1, 1, total_steps=100))  # victim must shrink
    view = broker.job(a.id)
    assert view.target_generation == 2 and view.acked_generation == 1  # between publish and ack
    wait_for(lambda: (protocol.read_json(handle.job_dir / protocol.DESIRED) or {}).get("generation") == 2,
             30, "agent to hand the new generation to the launcher")
    os.killpg(handle.launcher_pid, signal.SIGKILL)
    done = wait_for(lambda: broker.job(a.id).status.terminal and broker.job(a.id), 60, "victim to end")
    assert done.status is JobStatus.FAILED
    assert "launcher" in done.reason and "died" in done.reason
    assert held_by(broker, a.id) == []
    trainer = (protocol.read_json(handle.job_dir / protocol.STATUS) or {}).get("pid")
    assert trainer and not protocol.pid_alive(trainer)  # no orphan left training on released GPUs
    assert len(broker.job(b.id).target_gpus) == 1  # the newcomer got its GPU
    broker.cancel(b.id)


def test_a_restarted_triggerer_resumes_the_deferred_task_without_a_second_job(setup, monkeypatch):
    broker, backend, start = setup
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", str(broker.engine.url))
    job, handle = start("deferred", 60)
    first = ElasticTrainingTrigger(job.id, "elastic_gpu_missing_conn", 0.2, "local", str(handle.job_dir.parent))
    classpath, kwargs = first.serialize()

    async def run_briefly_then_die() -> None:  # the triggerer process goes away mid-poll
        agen = first.run()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(agen.__anext__(), 1.0)

    asyncio.run(run_briefly_then_die())
    assert classpath.endswith("ElasticTrainingTrigger")
    resumed = ElasticTrainingTrigger(**kwargs)  # a new triggerer rebuilds it from the stored kwargs
    event = asyncio.run(asyncio.wait_for(resumed.run().__anext__(), 90))
    assert event.payload["status"] == "succeeded" and event.payload["job_id"] == job.id
    assert len(broker.jobs()) == 1


@pytest.mark.postgres
def test_killed_database_connections_under_load_are_retried_without_breaking_an_invariant(postgres_server_url):
    _reset_postgres(postgres_server_url)
    admin = create_engine(postgres_server_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    name = postgres_server_url.rsplit("/", 1)[1]
    killed = [0]

    def terminate_every_connection() -> float:
        """What a server restart does to every client, four times: its connection is terminated."""
        t0 = time.monotonic()
        with admin.connect() as conn:
            for _ in range(4):
                killed[0] += conn.execute(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"), {"n": name}).scalar_one()
                time.sleep(0.3)
        return time.monotonic() - t0

    result = run_load(postgres_server_url, clients=8, ops=1200, seed=2, nodes=2, gpus_per_node=4, processes=2,
                      restart=terminate_every_connection, restart_after_s=0.5)
    admin.dispose()
    assert killed[0] > 0 and len(result["server_restarts"]) == 1
    assert result["client_failures"] == []
    assert result["operations"] == 1200
    assert result["violations_by_kind"] == {name: 0 for name in CHECKS}
    assert result["retried_transactions"] > 0


def test_a_drained_node_moves_its_job_and_keeps_its_progress(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    job = broker.submit(JobSpec("mover", "train", 1, 2, total_steps=1000))
    home = {g.node for g in job.target_gpus}
    assert len(home) == 1
    broker.ack(job.id, 1)
    broker.progress(job.id, 0.0, generation=1)
    broker.progress(job.id, 400.0, generation=1)
    (drained,) = home
    broker.set_node_schedulable(drained, False)
    moved = broker.job(job.id)
    assert moved.target_generation == 2 and {g.node for g in moved.target_gpus} == {"n0", "n1"} - home
    assert moved.steps_done == 400.0  # progress is the trainer's checkpoint, untouched by the move
    assert {g.node for g in moved.in_use_gpus} == home  # still held until the agent acks the move
    broker.ack(job.id, 2)
    after = broker.job(job.id)
    assert {g.node for g in after.in_use_gpus} == {"n0", "n1"} - home and after.num_resizes == 1


def test_a_drained_node_with_no_room_elsewhere_keeps_its_job_running_until_room_appears(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    a = broker.submit(JobSpec("a", "train", 2, 2, total_steps=1000, key="a"))
    b = broker.submit(JobSpec("b", "train", 2, 2, total_steps=1000, key="b"))
    for j in (a, b):
        broker.ack(j.id, 1)
    (a_node,) = {g.node for g in broker.job(a.id).in_use_gpus}
    broker.set_node_schedulable(a_node, False)
    kept = broker.job(a.id)
    assert kept.status is JobStatus.RUNNING and len(kept.in_use_gpus) == 2  # not silently stopped
    broker.finish(b.id)  # room appears on the other node: the job moves there
    moved = broker.job(a.id)
    assert moved.target_generation == 2 and a_node not in {g.node for g in moved.target_gpus}


def test_a_postgresql_server_that_never_answers_is_given_up_on_not_waited_for_for_ever():
    """A server that accepts the TCP connection and says nothing (a hung host, a half-open proxy):
    libpq's default is to wait for ever, which hung whatever broker call made the connection."""
    import socket

    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    from airflow_elastic_gpu.broker.db import POSTGRES_CONNECT_DEFAULTS, create_broker_engine

    silent = socket.create_server(("127.0.0.1", 0), backlog=8)  # the kernel accepts; nobody answers
    port = silent.getsockname()[1]
    try:
        seen: dict = {}
        engine = create_broker_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test?connect_timeout=1")
        event.listen(engine, "do_connect", lambda dialect, rec, cargs, cparams: seen.update(cparams))
        start = time.monotonic()
        with pytest.raises(OperationalError, match="timeout"):
            engine.connect()
        assert time.monotonic() - start < 5
        assert seen["connect_timeout"] == "1"  # the URL's own setting wins over the default
        assert {k: seen[k] for k in POSTGRES_CONNECT_DEFAULTS if k != "connect_timeout"} == {
            k: v for k, v in POSTGRES_CONNECT_DEFAULTS.items() if k != "connect_timeout"}
        engine.dispose()

        class Seen(Exception):
            pass

        def record(dialect, rec, cargs, cparams):
            seen.update(cparams)
            raise Seen  # no need to wait the default 10 s out again

        plain = create_broker_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test")
        event.listen(plain, "do_connect", record)
        assert plain.url.query == {}
        with pytest.raises(Seen):
            plain.connect()
        assert seen["connect_timeout"] == POSTGRES_CONNECT_DEFAULTS["connect_timeout"]
        plain.dispose()
        # libpq's own settings are not overridden: $PGCONNECT_TIMEOUT, and a service file's
        for env, query, absent in (({"PGCONNECT_TIMEOUT": "4"}, "", {"connect_timeout"}),
                                   ({}, "?service=broker", set(POSTGRES_CONNECT_DEFAULTS)),
                                   ({"PGSERVICE": "broker"}, "", set(POSTGRES_CONNECT_DEFAULTS))):
            seen.clear()
            with pytest.MonkeyPatch.context() as mp:
                for name, value in env.items():
                    mp.setenv(name, value)
                other = create_broker_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test{query}")
            event.listen(other, "do_connect", record)
            with pytest.raises(Seen):
                other.connect()
            assert absent and not absent & seen.keys() and set(POSTGRES_CONNECT_DEFAULTS) - absent <= seen.keys()
            other.dispose()
    finally:
        silent.close()
