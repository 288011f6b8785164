"""The agent's judgement at the edges of a job's life, with a stand-in broker and launcher files (no
processes but one whose pid stands for a reused one): a gang failed only once its trainers stopped,
a dead launcher whose pid another process took, and a pod replaced while a call of the agent waited."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent
from airflow_elastic_gpu.states import JobStatus, Target


class Broker:
    """Answers heartbeats with ``targets`` in turn (the last one for ever) and records reports."""

    def __init__(self, *targets: Target) -> None:
        self.targets, self.calls = list(targets), []

    def heartbeat(self, job_id: str) -> Target:
        return self.targets.pop(0) if len(self.targets) > 1 else self.targets[0]

    def progress(self, *args, **kwargs) -> None:
        pass

    def ack(self, *args, **kwargs) -> bool:
        return True

    def finish(self, job_id, *args, **kwargs) -> None:
        self.calls.append(("finish", args, kwargs))

    def fail(self, job_id, reason, *args, **kwargs) -> None:
        self.calls.append(("fail", reason, kwargs))


def run(agent: Agent, within_s: float = 30) -> int:
    """``agent.run()``'s result; an agent still running after ``within_s`` is terminated and fails the test."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(agent.run()), daemon=True)
    thread.start()
    thread.join(within_s)
    if thread.is_alive():
        agent.terminate()
        thread.join(5)
        raise AssertionError(f"the agent still ran after {within_s}s")
    return result[0]


def _gang(tmp_path: Path) -> Path:
    for rank, node in enumerate(("a", "b")):
        (tmp_path / "nodes" / node).mkdir(parents=True)
        protocol.write_json(tmp_path / "nodes" / node / protocol.DESIRED, {
            "generation": 1, "gpus": [0], "nnodes": 2, "node_rank": rank, "stop": False})
        protocol.write_json(tmp_path / "nodes" / node / protocol.STATUS, {
            "generation": 1, "state": protocol.RUNNING, "launcher_pid": os.getpid()})
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [["a", 0], ["b", 0]], "stop": False})
    return tmp_path


def test_a_gang_generation_it_cannot_run_fails_the_job_only_once_every_trainer_stopped(tmp_path):
    """A node joined the pool after the job started (no launcher there): the job was failed at once,
    which frees its GPUs, while both nodes' trainers ran on them until the next heartbeat."""
    d = _gang(tmp_path)
    target = Target("j", JobStatus.RUNNING, 2, (GpuId("a", 0), GpuId("c", 0)), 60.0)
    stuck = Broker(target)
    assert run(Agent(stuck, "j", d, poll_s=0.01, stop_timeout_s=0.3), 10) == 1
    assert stuck.calls == [], "nothing reported while the trainers run: the lease ends the job"
    assert all((d / "nodes" / n / protocol.STOP).exists() for n in ("a", "b"))

    def launchers_stop() -> None:  # each launcher stops its trainer once asked
        while not all((d / "nodes" / n / protocol.STOP).exists() for n in ("a", "b")):
            threading.Event().wait(0.01)
        for n in ("a", "b"):
            protocol.write_json(d / "nodes" / n / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})

    for n in ("a", "b"):
        (d / "nodes" / n / protocol.STOP).unlink()
        protocol.write_json(d / "nodes" / n / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING,
                                                                 "launcher_pid": os.getpid()})
    threading.Thread(target=launchers_stop, daemon=True).start()
    stopping = Broker(target)
    assert run(Agent(stopping, "j", d, poll_s=0.01, stop_timeout_s=5)) == 0
    [(what, reason, _)] = stopping.calls
    assert what == "fail" and "no launcher on" in reason


def test_a_dead_launcher_whose_pid_another_process_took_is_gone(tmp_path):
    """An OOM-killed launcher's pid reused: the agent heartbeat on for ever, so neither the fence
    nor the lease ended the job, and its GPUs stayed held."""
    other = subprocess.Popen(["sleep", "30"])  # the process that has the launcher's pid now
    try:
        agent = Agent(Broker(), "j", tmp_path, launcher_pid=other.pid)
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING,
                                                          "launcher_pid": other.pid})
        assert agent._launcher_gone() is None  # the launcher itself
        agent.launcher_starts[other.pid] += 1  # recorded as started at another time: it ended
        assert agent._launcher_gone() == other.pid
    finally:
        other.kill()
        other.wait()


def test_a_pod_replaced_while_a_call_waited_is_not_the_jobs_failure(tmp_path):
    """A re-created pod (one generation a pod): the broker publishes generation 2 and the backend
    deletes the pod while the agent's progress report waits on the rebalance's lock. The launcher
    reads stopped; the agent's heartbeat of that poll said generation 1, and it failed the job
    ("the launcher was stopped from outside the broker")."""
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING})
    (tmp_path / protocol.LOG).write_text('{"step": 5}\n')

    class Replacing(Broker):
        def progress(self, *args, **kwargs) -> None:  # slow: the rebalance publishing generation 2
            self.targets = [Target("j", JobStatus.RUNNING, 2, (GpuId("n1", 0),), 60.0)]
            protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})

        def heartbeat(self, job_id: str) -> Target:
            with open(tmp_path / protocol.LOG, "a") as log:
                log.write('{"step": 6}\n')  # progress to report on every poll
            return super().heartbeat(job_id)

    for terminated in (False, True):  # the agent's SIGTERM came before its next poll, or not yet
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING})
        broker = Replacing(Target("j", JobStatus.RUNNING, 1, (GpuId("n1", 0),), 60.0))
        agent = Agent(broker, "j", tmp_path, poll_s=0.01, pod_generation=1, host_node="n1", end_report_timeout_s=1)
        if terminated:
            broker.progress = lambda *a, _p=broker.progress, _agent=agent, **k: (_p(), _agent.terminate())
        assert run(agent, 10) == 0
        assert broker.calls == [], terminated



def _stops_when_asked(d: Path, stopped: dict) -> None:
    """A stand-in launcher: its trainer runs until ``stop.json`` appears, then reports ``stopped``."""
    while not (d / protocol.STOP).exists():
        threading.Event().wait(0.01)
    protocol.write_json(d / protocol.STATUS, stopped)


@pytest.mark.parametrize("restored", ["an older generation", "the same generation on other GPUs"])
def test_a_broker_whose_record_went_back_has_the_trainer_stopped_and_the_job_failed(tmp_path, restored):
    """The broker's database restored from a backup (or failed over to a replica that lost the latest
    commits): it answers with generation 1 on GPU 0, or with a generation 2 of its own on GPU 0, while
    the trainer runs generation 2 on GPU 1. The agent took the answer as nothing new and renewed the
    lease: the trainer trained on, on a GPU the broker then handed to another job."""
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": False})
    running = {"generation": 2, "state": protocol.RUNNING, "launcher_pid": os.getpid()}
    protocol.write_json(tmp_path / protocol.STATUS, running)
    generation = 1 if restored == "an older generation" else 2
    broker = Broker(Target("j", JobStatus.RUNNING, generation, (GpuId("n1", 0),), 60.0))
    threading.Thread(target=_stops_when_asked, args=(tmp_path, {**running, "state": protocol.STOPPED}),
                     daemon=True).start()
    assert run(Agent(broker, "j", tmp_path, poll_s=0.01, stop_timeout_s=5)) == 0
    [(what, reason, _)] = broker.calls
    assert what == "fail" and "restored or failed over" in reason, reason
    assert protocol.read_json(tmp_path / protocol.DESIRED)["generation"] == 2, "nothing new was written"
    assert not (tmp_path / protocol.LEASE).exists(), "the lease was not renewed on the broker's word"


def test_a_gang_whose_broker_record_went_back_stops_every_node(tmp_path):
    """The same for a gang of launchers on one host: generation 1 names other GPUs after a restore."""
    d = _gang(tmp_path)
    for n in ("a", "b"):
        threading.Thread(target=_stops_when_asked, daemon=True, args=(d / "nodes" / n, {
            "generation": 1, "state": protocol.STOPPED, "launcher_pid": os.getpid()})).start()
    broker = Broker(Target("j", JobStatus.RUNNING, 1, (GpuId("a", 0), GpuId("b", 1)), 60.0))
    assert run(Agent(broker, "j", d, poll_s=0.01, stop_timeout_s=5)) == 0
    [(what, reason, _)] = broker.calls
    assert what == "fail" and "names other GPUs" in reason, reason


def test_the_broker_answering_the_generation_written_is_not_a_restore(tmp_path):
    """The usual answer (the generation the trainer runs, on its GPUs) changes nothing."""
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": False})
    agent = Agent(Broker(), "j", tmp_path)
    assert agent._went_back(Target("j", JobStatus.RUNNING, 2, (GpuId("n1", 1),), 60.0), 2) is None
    assert agent._went_back(Target("j", JobStatus.RUNNING, 3, (GpuId("n1", 0),), 60.0), 2) is None

_SIGNAL_WHILE_LOCKED = """
import os, signal, sys, threading, time
from airflow_elastic_gpu.sidecar.agent_cli import on_signal
event = threading.Event()
signal.signal(signal.SIGTERM, on_signal(event.set))
with event._cond:  # the instant Event.wait holds its condition's lock
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs in this thread, here
print("set" if event.wait(5) else "not set", flush=True)
"""


def test_a_sigterm_while_the_agent_holds_its_events_lock_does_not_hang_it():
    """The handler called ``Event.set`` in the main thread, which may hold the event's lock inside
    ``Event.wait``: it waited for itself for ever (a CPython hazard), with the trainer's GPUs."""
    import sys

    run = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_LOCKED], capture_output=True, text=True,
                         timeout=30, check=False)
    assert run.stdout.strip() == "set", run.stderr[-2000:]


def test_a_trainer_its_killed_launcher_never_recorded_is_killed_before_the_job_fails(tmp_path):
    """The launcher SIGKILLed between starting the trainer and writing its pid to ``status.json``
    (or a worker started since the last record): the agent killed only the recorded processes and
    failed the job, which freed its GPUs while the unrecorded trainer trained on them."""
    import sys

    from airflow_elastic_gpu.backends.local_processes import JOB_MARK

    env = {**os.environ, JOB_MARK: "job-unrecorded"}
    launcher = subprocess.Popen(["sleep", "30"], env=env)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                               start_new_session=True)
    try:
        protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STARTING,
                                                          "launcher_pid": launcher.pid})
        broker = Broker(Target("job-unrecorded", JobStatus.RUNNING, 1, (GpuId("n1", 0),), 60.0))
        agent = Agent(broker, "job-unrecorded", tmp_path, poll_s=0.01, launcher_pid=launcher.pid)
        launcher.kill()
        launcher.wait()
        assert run(agent, 30) == 1
        [(what, reason, _)] = broker.calls
        assert what == "fail" and "died without reporting an exit" in reason, reason
        assert trainer.wait(5) == -9, "the unrecorded trainer was killed"
    finally:
        for p in (launcher, trainer):
            p.kill()
            p.wait()
