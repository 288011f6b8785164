"""The launcher and the agent with real subprocesses (a tiny stand-in trainer, no PyTorch)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow_elastic_gpu.backends.local import BackendError, LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker, compile_progress_pattern
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent
from airflow_elastic_gpu.sidecar.logparse import LogParser
from airflow_elastic_gpu.states import Target

TRAINER = """
import json, os, signal, sys, time
ignore = os.environ.get("IGNORE_TERM") == "1"
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else (lambda *_: sys.exit(143)))
print(json.dumps({k: os.environ.get(k) for k in
      ["CUDA_VISIBLE_DEVICES", "ELASTIC_GPU_COUNT", "ELASTIC_GENERATION", "ELASTIC_CHECKPOINT_DIR"]}
      | {"argv": sys.argv[1:]}), flush=True)
steps = int(sys.argv[2])
for step in range(1, steps + 1):
    time.sleep(0.05)
    print(json.dumps({"step": step}), flush=True)
print(json.dumps({"final": True, "step": steps, "accuracy": 0.95}), flush=True)
"""


def wait_for(predicate, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def trainer(tmp_path) -> Path:
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER)
    return path


def start_launcher(shared: Path, command: str, grace_s: float = 5.0, env=None) -> subprocess.Popen:
    shared.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_elastic_gpu.sidecar.launcher", "--shared-dir", str(shared),
         "--grace-s", str(grace_s), "--poll-s", "0.05", "--", command], env=env,
    )


def log_json(shared: Path) -> list[dict]:
    out = []
    path = shared / protocol.LOG
    for line in (path.read_text() if path.exists() else "").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_launcher_exports_the_generation_and_expands_num_gpus(tmp_path, trainer):
    shared = tmp_path / "job"
    proc = start_launcher(shared, f"{sys.executable} {trainer} --gpus={{num_gpus}} 3")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [2, 3], "stop": False})
    assert proc.wait(30) == 0
    env = log_json(shared)[0]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["ELASTIC_GPU_COUNT"] == "2"
    assert env["ELASTIC_GENERATION"] == "1" and env["argv"] == ["--gpus=2", "3"]
    assert env["ELASTIC_CHECKPOINT_DIR"] == str(shared / "checkpoints")
    status = protocol.read_json(shared / protocol.STATUS)
    assert status["state"] == protocol.EXITED and status["exit_code"] == 0


def test_launcher_restarts_the_trainer_on_a_new_generation(tmp_path, trainer):
    shared = tmp_path / "job"
    proc = start_launcher(shared, f"{sys.executable} {trainer} x 100000")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    wait_for(lambda: len(log_json(shared)) > 3, what="generation 1 progress")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [0, 1, 2], "stop": False})
    wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("generation") == 2
             and any(e.get("ELASTIC_GENERATION") == "2" for e in log_json(shared)), what="generation 2")
    status = protocol.read_json(shared / protocol.STATUS)
    assert status["restarts"] == 1 and status["state"] == protocol.RUNNING
    protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [0, 1, 2], "stop": True})
    assert proc.wait(30) == 0
    assert protocol.read_json(shared / protocol.STATUS)["state"] == protocol.STOPPED


def test_a_generation_without_gpus_suspends_the_trainer_and_a_later_one_resumes_it(tmp_path, trainer):
    shared = tmp_path / "job"
    proc = start_launcher(shared, f"{sys.executable} {trainer} x 100000")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0, 1], "stop": False})
    wait_for(lambda: len(log_json(shared)) > 3, what="generation 1 progress")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [], "stop": False})
    wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("state") == protocol.SUSPENDED,
             what="suspended")
    status = protocol.read_json(shared / protocol.STATUS)
    assert status["generation"] == 2 and status["pid"] is None and status["workers"] == []
    assert proc.poll() is None, "the launcher waits to resume"
    lines = len(log_json(shared))
    time.sleep(0.5)
    assert len(log_json(shared)) == lines, "no trainer runs while suspended"
    protocol.write_json(shared / protocol.DESIRED, {"generation": 3, "gpus": [1], "stop": False})
    wait_for(lambda: any(e.get("ELASTIC_GENERATION") == "3" for e in log_json(shared)), what="resumed")
    assert protocol.read_json(shared / protocol.STATUS)["state"] == protocol.RUNNING
    protocol.write_json(shared / protocol.DESIRED, {"generation": 3, "gpus": [1], "stop": True})
    assert proc.wait(30) == 0


def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, trainer):
    shared = tmp_path / "job"
    env = {**__import__("os").environ, "IGNORE_TERM": "1"}
    proc = start_launcher(shared, f"{sys.executable} {trainer} x 100000", grace_s=1.0, env=env)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    wait_for(lambda: len(log_json(shared)) > 2, what="progress")
    started = time.monotonic()
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": True})
    assert proc.wait(30) == 0
    assert 0.9 <= time.monotonic() - started < 10
    assert "SIGKILL" in (shared / protocol.LOG).read_text()


def test_an_echoing_launcher_copies_the_trainer_s_last_lines_before_it_exits(tmp_path):
    """A container's log is the launcher's stdout: the lines a trainer prints just before it ends
    (its final metrics, a traceback) must be in it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    done = subprocess.run(
        [sys.executable, "-m", "airflow_elastic_gpu.sidecar.launcher", "--shared-dir", str(shared), "--echo",
         "--poll-s", "0.01", "--", f"{sys.executable} -c \"print('the last line')\""],
        check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    *_, last, note = done.stdout.splitlines()
    assert last == "the last line" and note.endswith("trainer exited with code 0")


def test_launcher_reports_a_command_that_is_not_found(tmp_path):
    shared = tmp_path / "job"
    proc = start_launcher(shared, "no-such-trainer-binary --x")
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    assert proc.wait(30) == 127
    assert protocol.read_json(shared / protocol.STATUS)["exit_code"] == 127
    assert "command not found" in (shared / protocol.LOG).read_text()


def test_local_backend_rejects_a_missing_command_before_starting_anything(tmp_path):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")  # a file: its agents must reach it
    broker.register_node("localhost", 1)
    backend = LocalBackend(tmp_path, broker)
    job = broker.submit(JobSpec("missing", "no-such-trainer-binary --steps 3", total_steps=3))
    with pytest.raises(BackendError, match="command not found: 'no-such-trainer-binary'"):
        backend.start(job)
    with pytest.raises(BackendError, match="does not parse"):
        backend.check("python 'unterminated", None)
    with pytest.raises(BackendError, match="checkpoint_dir .* cannot be created"):
        backend.check("python train.py", "/proc/no/such/dir")
    assert not (tmp_path / job.id).exists()


def test_log_parser_reads_json_lines_generations_and_metrics(tmp_path):
    log = tmp_path / "train.log"
    log.write_text('[launcher 10:00:00] generation 1: starting on GPUs [0]: x\n{"step": 5}\nnoise\n{"step": 9')
    parser = LogParser()
    assert parser.read(log) == [(1, 5.0)]
    with open(log, "a") as f:
        f.write('}\n[launcher 10:00:05] generation 2: starting on GPUs [0]: x\n{"final": true, "step": 12, "accuracy": 0.9}\n')
    assert parser.read(log) == [(1, 9.0), (2, 12.0)]
    assert parser.metrics["accuracy"] == 0.9


def test_log_parser_uses_a_progress_regex(tmp_path):
    """With a progress pattern the steps come from it, and the final metrics line is read all the
    same (it was ignored: the job ended without its accuracy)."""
    log = tmp_path / "train.log"
    log.write_text('epoch 1 iter 40/100 loss 0.3\nepoch 1 iter 80/100 loss 0.2\n{"final": true, "accuracy": 0.93}\n')
    parser = LogParser(compile_progress_pattern(r"iter (?P<step>\d+)/"))
    assert [s for _, s in parser.read(log)] == [40.0, 80.0]
    assert parser.metrics == {"final": True, "accuracy": 0.93}


def test_a_progress_bar_redrawn_with_carriage_returns_is_read_as_it_goes(tmp_path):
    """tqdm redraws its bar with ``\r``: split on ``\n`` alone, no step was read until the bar
    ended with a newline, and then only the first drawing's; the unfinished line grew all along."""
    from airflow_elastic_gpu.sidecar import logparse

    log = tmp_path / "train.log"
    log.write_text("loading\r\n" + "\r".join(f"train:  40%|#### | {s}/500" for s in (100, 200, 300)))
    parser = LogParser(compile_progress_pattern(r"\| (?P<step>\d+)/500"))
    assert [s for _, s in parser.read(log)] == [100.0, 200.0]
    with open(log, "a") as f:
        f.write("\r" + "x" * (logparse.PARTIAL_CHARS * 2))
    assert [s for _, s in parser.read(log)] == [300.0] and len(parser._partial) == logparse.PARTIAL_CHARS


def test_a_restarted_agent_reads_only_the_end_of_a_long_log(tmp_path, monkeypatch):
    """A restarted agent takes the log already reported as read: it read the whole of it at once
    (a 93 MB log took 525 MB and 7 s before its first heartbeat). It reads the end only, for the
    last lines and the final metrics; a read never takes more than READ_BYTES."""
    from airflow_elastic_gpu.sidecar import logparse

    monkeypatch.setattr(logparse, "SKIP_KEEP_BYTES", 4096)
    monkeypatch.setattr(logparse, "READ_BYTES", 1 << 16)
    log = tmp_path / "train.log"
    log.write_text("".join(f'{{"step": {i}}}\n' for i in range(20_000)) + '{"final": true, "accuracy": 0.9}\n')
    parser = LogParser()
    parser.skip(log)
    assert parser.metrics == {"final": True, "accuracy": 0.9} and parser.tail[-2] == '{"step": 19999}'
    with open(log, "a") as f:
        f.write('{"step": 20000}\n')
    assert parser.read(log) == [(0, 20000.0)]
    fresh = LogParser()
    assert len(fresh.read(log)) < 20_000 and fresh.read(log)  # a long log is read over several polls


@pytest.fixture
def real_broker(broker_url):
    """A broker on the real clock: the agent processes it talks to use the real clock too."""
    broker = GpuBroker(broker_url)
    yield broker
    broker.engine.dispose()


def test_agent_and_launcher_run_a_job_through_the_broker(tmp_path, trainer, real_broker):
    broker = real_broker
    broker.register_node("localhost", 2)
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=5)
    job = broker.submit(JobSpec("tiny", f"{sys.executable} {trainer} x 20", 1, 2, total_steps=20))
    broker.start(job.id, backend.start(job))
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 60, "job end")
    assert done.status is JobStatus.SUCCEEDED, done.reason
    assert done.steps_done == 20 and done.metrics["accuracy"] == 0.95
    assert done.acked_generation == 1 and done.in_use_gpus == ()
    wait_for(lambda: not backend.is_running(job.id), 10, "processes to exit")


def test_a_crashing_trainer_fails_the_job_with_its_last_log_lines(tmp_path, real_broker):
    broker = real_broker
    broker.register_node("localhost", 1)
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('loading data')\nprint('CUDA error: out of memory', flush=True)\nsys.exit(3)\n")
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2)
    job = broker.submit(JobSpec("crash", f"{sys.executable} {crash}", 1, 1, total_steps=10))
    broker.start(job.id, backend.start(job))
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 60, "job end")
    assert done.status is JobStatus.FAILED and done.exit_code == 3
    assert "trainer exited with code 3" in done.reason and "out of memory" in done.reason


def test_stopping_reaches_workers_that_run_in_their_own_session(tmp_path):
    """torchrun starts each worker in its own session: a group signal misses them. The launcher
    tracks the trainer's descendants and stops them too, so no worker outlives a resize or a stop."""
    worker = tmp_path / "worker.py"
    worker.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, time, signal\n"
        f"subprocess.Popen([sys.executable, {str(worker)!r}], start_new_session=True)\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        "while True:\n    time.sleep(0.1)\n")
    shared = tmp_path / "shared"
    proc = start_launcher(shared, f"{sys.executable} {parent}", grace_s=2.0)
    try:
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
        status = wait_for(lambda: (protocol.read_json(shared / protocol.STATUS) or {}).get("workers")
                          and protocol.read_json(shared / protocol.STATUS), 30, "the worker to be tracked")
        (child,) = status["workers"]
        assert protocol.pid_alive(child) and os.getsid(child) != os.getsid(status["pid"])
        protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": True})
        assert proc.wait(30) == 0
        wait_for(lambda: not protocol.pid_alive(child), 10, "the worker in its own session to be stopped")
    finally:
        proc.kill()


def test_the_sidecar_loads_nothing_of_the_broker():
    """The agent and launcher run with only their transport: importing them loads no broker module
    (the database transport is imported by whoever chooses it)."""
    code = ("import sys, airflow_elastic_gpu.sidecar.agent, airflow_elastic_gpu.sidecar.agent_cli, "
            "airflow_elastic_gpu.sidecar.launcher, "
            "airflow_elastic_gpu.sidecar.http_transport; "
            "print(sorted(m for m in sys.modules if m.startswith('airflow_elastic_gpu.broker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


class MovedOnBroker:
    """A transport whose job has moved on to ``generation`` (GPU 0) and that records the reports."""

    def __init__(self, generation: int, gpus: tuple[GpuId, ...] = (GpuId("node", 0),)) -> None:
        self.generation = generation
        self.gpus = gpus
        self.calls: list[str] = []

    def heartbeat(self, job_id):
        return Target(job_id, JobStatus.RUNNING, self.generation, self.gpus, lease_s=60.0)

    def progress(self, job_id, step, *, generation=None, time_s=None):
        self.calls.append("progress")

    def ack(self, job_id, generation):
        self.calls.append(f"ack {generation}")
        return True

    def finish(self, job_id, exit_code=0, metrics=None):
        self.calls.append("finish")

    def fail(self, job_id, reason, exit_code=None, metrics=None):
        self.calls.append(f"fail: {reason}")


def running(shared: Path, generation: int) -> None:
    """The launcher runs ``generation`` on GPU 0 (:class:`MovedOnBroker`'s GPU)."""
    protocol.write_json(shared / protocol.DESIRED, {"generation": generation, "gpus": [0], "stop": False})
    protocol.write_json(shared / protocol.STATUS, {"generation": generation, "state": protocol.RUNNING})


def test_a_pod_of_one_generation_leaves_a_newer_one_to_its_replacement(tmp_path):
    """Re-creation mode: the old pod's trainer is not restarted in place on the new generation, and
    its stop (the pod's deletion) does not fail the job."""
    running(tmp_path, 1)
    broker = MovedOnBroker(2)
    agent = Agent(broker, "job", tmp_path, poll_s=0.01, pod_generation=1)
    stopped = threading.Timer(0.3, lambda: protocol.write_json(
        tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED}))
    stopped.start()
    assert agent.run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED)["generation"] == 1
    assert not [c for c in broker.calls if c.startswith(("ack", "fail"))]


@pytest.mark.parametrize(("newest", "failed"), [(2, False), (1, True)])
def test_a_replaced_pods_trainer_that_died_with_its_generation_does_not_fail_the_job(tmp_path, newest, failed):
    """Re-creation mode, a gang: the first old pod deleted breaks the others' rendezvous, and their
    trainers exit non-zero before their own pods' deletion reaches them. The broker has moved past
    their generation, so that exit is not the job's end (the new pods run it); the same exit in
    the generation the broker runs is a failure."""
    running(tmp_path, 1)
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 1})
    broker = MovedOnBroker(newest)
    assert Agent(broker, "job", tmp_path, poll_s=0.01, pod_generation=1).run() == 0
    assert [c for c in broker.calls if c.startswith("fail")] == (
        ["fail: trainer exited with code 1"] if failed else [])


def test_an_in_place_pod_leaves_a_generation_on_another_node_to_its_replacement(tmp_path):
    """The job moved to another node: the generation's device indices name that node's GPUs, so the
    pod's trainer is not restarted on them here (on this node they may be another job's), and the
    pod's deletion does not fail the job. A generation on its own node is applied as usual."""
    running(tmp_path, 1)
    broker = MovedOnBroker(2, gpus=(GpuId("other-node", 0),))
    agent = Agent(broker, "job", tmp_path, poll_s=0.01, host_node="this-node")
    threading.Timer(0.3, lambda: protocol.write_json(
        tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})).start()
    assert agent.run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED)["generation"] == 1
    assert not [c for c in broker.calls if c.startswith(("ack", "fail"))]
    here = Agent(MovedOnBroker(2, gpus=(GpuId("this-node", 3),)), "job", tmp_path, host_node="this-node")
    assert here._apply(here.broker.heartbeat("job"), 1) == 2
    assert protocol.read_json(tmp_path / protocol.DESIRED) == {"generation": 2, "gpus": [3], "stop": False}


def test_a_pod_of_one_generation_still_applies_a_suspension(tmp_path):
    """A generation with no GPUs (a preemptible job suspended) is applied in the pod: the trainer
    checkpoints and stops, and the ack frees its GPUs; the pod is re-created on resume."""
    running(tmp_path, 1)
    agent = Agent(MovedOnBroker(2, gpus=()), "job", tmp_path, poll_s=0.01, pod_generation=1)
    threading.Timer(0.3, lambda: protocol.write_json(
        tmp_path / protocol.STATUS, {"generation": 2, "state": protocol.STOPPED})).start()
    assert agent.run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED) == {"generation": 2, "gpus": [], "stop": False}


class BlippingBroker(MovedOnBroker):
    """:class:`MovedOnBroker` whose first ``failures`` heartbeats fail (the broker's API away a moment)."""

    def __init__(self, generation: int, failures: int = 1, **kw) -> None:
        super().__init__(generation, **kw)
        self.failures = failures

    def heartbeat(self, job_id):
        if self.failures > 0:
            self.failures -= 1
            raise OSError("connection refused")
        return super().heartbeat(job_id)


@pytest.mark.parametrize("status", [{"state": protocol.STOPPED}, {"state": protocol.EXITED, "exit_code": 1}])
def test_a_pod_being_replaced_is_not_taken_for_stopped_from_outside_on_a_failed_heartbeat(tmp_path, status):
    """Re-creation mode: the old pod's launcher stopped (or its trainer died with the gang's
    rendezvous) in a poll whose heartbeat failed; the agent judged it on the generation it had seen
    before, took it for a stop from outside and failed a job that had only moved to a new pod."""
    running(tmp_path, 1)
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, **status})
    broker = BlippingBroker(2, failures=2)
    assert Agent(broker, "job", tmp_path, poll_s=0.01, pod_generation=1).run() == 0
    assert not [c for c in broker.calls if c.startswith("fail")]
    # the pod's deletion (SIGTERM) comes first: the agent asks the broker before it reports
    broker = MovedOnBroker(2)
    agent = Agent(broker, "job", tmp_path, poll_s=0.01, pod_generation=1)
    agent.terminate()
    assert agent.run() == 0
    assert not [c for c in broker.calls if c.startswith("fail")]


def test_a_stopped_launcher_of_the_current_generation_still_fails_the_job(tmp_path):
    running(tmp_path, 1)
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})
    broker = MovedOnBroker(1)
    assert Agent(broker, "job", tmp_path, poll_s=0.01, pod_generation=1).run() == 1
    assert broker.calls[-1] == "fail: the launcher was stopped from outside the broker"


def test_a_terminated_agent_still_reports_a_trainer_exit_it_has_seen(tmp_path):
    running(tmp_path, 1)
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})
    broker = MovedOnBroker(1)
    agent = Agent(broker, "job", tmp_path, poll_s=0.01)
    agent.terminate()
    assert agent.run() == 0 and broker.calls[-1] == "finish"


def test_sigterm_ends_the_agent_process(tmp_path):
    """A container's first process ignores a signal it has no handler for: without one the agent
    would hold a pod's deletion for the whole grace period."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: every heartbeat is a transient failure
    token = tmp_path / "token"
    token.write_text("t")
    agent = subprocess.Popen([sys.executable, "-m", "airflow_elastic_gpu.sidecar.agent", "--job-id", "job",
                              "--shared-dir", str(tmp_path / "shared"), "--broker-api", f"http://127.0.0.1:{port}",
                              "--token-file", str(token), "--poll-s", "0.2"], stderr=subprocess.PIPE, text=True)
    try:
        assert "heartbeat failed" in agent.stderr.readline()  # running: its handler is installed
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0  # handled: an unhandled SIGTERM would read -15
        assert "terminated (the pod is being deleted)" in agent.stderr.read()
    finally:
        agent.kill()
