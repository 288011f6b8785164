"""The launcher where its trainer's exit meets the broker's next instruction: an exit is reported
before a new generation, a suspension or a stop is acted on; workers of a trainer that died are
killed before anything runs on its GPUs again; no trainer starts on a lease that went stale
during a stop; the launcher's lines never glue onto a trainer's unfinished one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_sidecar import wait_for

from airflow_elastic_gpu.sidecar import protocol, stops
from airflow_elastic_gpu.sidecar.launcher import Launcher
from airflow_elastic_gpu.sidecar.logparse import LogParser


def status(shared: Path) -> dict:
    return protocol.read_json(shared / protocol.STATUS) or {}


def checkpointing_trainer(tmp_path: Path, stop_s: float = 0.0) -> Path:
    """A trainer that, on SIGTERM, takes ``stop_s`` to checkpoint, then appends its generation to
    ``checkpointed`` and exits."""
    trainer = tmp_path / "ckpt_trainer.py"
    trainer.write_text("import os, signal, sys, time\n"
                       "gen = os.environ['ELASTIC_GENERATION']\n"
                       f"signal.signal(signal.SIGTERM, lambda *_: (time.sleep({stop_s}), open("
                       f"{str(tmp_path / 'checkpointed')!r}, 'a').write(gen), sys.exit(0)))\n"
                       "while True:\n    time.sleep(0.05)\n")
    return trainer


@contextlib.contextmanager
def launcher_running(launcher: Launcher) -> Iterator[tuple[threading.Thread, list[int]]]:
    """``launcher._run()`` in a daemon thread: the thread, and the list its exit code goes to; a
    launcher still running at the end is stopped (SIGTERM's flag) and waited for."""
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(launcher._run()), daemon=True)
    runner.start()
    try:
        yield runner, done
    finally:
        if runner.is_alive():
            launcher._terminated.set()
            runner.join(30)


@pytest.mark.parametrize("next_desired", [
    {"generation": 2, "gpus": [0, 1], "stop": False},  # a resize
    {"generation": 2, "gpus": [], "stop": False},  # a suspension
    {"generation": 1, "gpus": [0], "stop": True},  # a stop
])
@pytest.mark.parametrize("code", [0, 3])
def test_an_exit_that_happened_is_reported_whatever_came_next(tmp_path, next_desired, code):
    """The trainer exits while the broker's next instruction arrives within the same poll: the
    exit is reported (a success was restarted from its checkpoint, or hidden until a resume; a
    failure was retried unannounced)."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} -c 'import sys; sys.exit({code})'", grace_s=2.0, poll_s=0.05)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    launcher.generation = 1
    launcher._start(protocol.read_json(shared / protocol.DESIRED))
    launcher.proc.wait(30)  # it has exited; the launcher has not looked yet
    protocol.write_json(shared / protocol.DESIRED, next_desired)
    assert launcher._run() == code
    assert status(shared)["state"] == protocol.EXITED and status(shared)["exit_code"] == code
    assert launcher.restarts == 0


def test_workers_of_a_trainer_that_died_are_killed_before_its_gpus_are_used_again(tmp_path):
    """torchrun killed (a SIGKILL, a segfault) leaves its workers, each in a session of its own:
    stopping the dead trainer for a resize still kills them."""
    worker = tmp_path / "worker.py"
    worker.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, "true", grace_s=2.0, poll_s=0.05)
    launcher.proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, {str(worker)!r}], start_new_session=True)"])
    launcher.proc.wait(30)
    orphan = wait_for(lambda: next((p for p in _pids_running(worker)), None), 10, "the worker to run")
    launcher.tree = [orphan]
    assert launcher._stop() == 0
    wait_for(lambda: not protocol.pid_alive(orphan), 5, "the orphaned worker to be killed")
    assert launcher.tree == []


@pytest.mark.parametrize(("stat", "waited"), [
    (("D", 4242), True),  # stuck in the kernel (uninterruptible sleep): waited for
    (("S", 4242), False),  # asleep and alive after SIGKILL: not the worker, another process has the pid
])
def test_a_worker_stuck_in_the_kernel_is_waited_for_before_the_trainer_counts_as_stopped(
        tmp_path, monkeypatch, stat, waited):
    """A process stuck in the kernel (uninterruptible sleep in a GPU driver) survives SIGKILL for a
    while and may hold its GPU: the launcher waits for it and says so, where it gave up after 2 s
    and let the next generation, or another job, have the GPU. A process alive after SIGKILL and not
    stuck has the pid now (a kernel thread, another user's): never waited on for ever. (No test can
    put a process into uninterruptible sleep: a pid above ``pid_max``, which no process can have,
    plays the worker, with its ``/proc`` state given; signals to it fail as to any gone process.)"""
    stuck = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7
    alive_until = time.monotonic() + 3.5
    real_alive, real_stat = protocol.pid_alive, protocol.proc_stat
    monkeypatch.setattr(protocol, "pid_alive",
                        lambda pid: time.monotonic() < alive_until if pid == stuck else real_alive(pid))
    monkeypatch.setattr(protocol, "proc_stat", lambda pid: (stat if time.monotonic() < alive_until else None)
                        if pid == stuck else real_stat(pid))
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, "true", grace_s=1.0, poll_s=0.05)
    launcher.proc = subprocess.Popen(["true"])
    launcher.proc.wait(30)  # the trainer died; its worker did not
    launcher.tree = [stuck]
    assert launcher._stop() == 0
    assert (time.monotonic() >= alive_until) is waited and launcher.tree == []
    log = (shared / protocol.LOG).read_text()
    assert (f"process(es) [{stuck}] still alive after SIGKILL (stuck in the kernel)" in log) is waited
    assert (f"pid(s) [{stuck}] alive after SIGKILL but not stuck in the kernel" in log) is not waited


def test_a_stuck_workers_pid_taken_by_a_new_process_ends_the_wait(tmp_path, monkeypatch):
    """The stuck worker goes and a new process gets its pid (another start time): the wait ends."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 9
    reused_at = time.monotonic() + 2.5
    real_alive, real_stat = protocol.pid_alive, protocol.proc_stat
    monkeypatch.setattr(protocol, "pid_alive", lambda p: True if p == pid else real_alive(p))
    monkeypatch.setattr(protocol, "proc_stat", lambda p: (("D", 1) if time.monotonic() < reused_at else ("S", 2))
                        if p == pid else real_stat(p))
    launcher = Launcher(tmp_path, "true", grace_s=1.0, poll_s=0.05)
    launcher.tree = [pid]
    launcher._kill_workers()
    assert reused_at <= time.monotonic() < reused_at + 5 and launcher.tree == []


def _pids_running(script: Path) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(script).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("newer_during_the_stop", [False, True])
def test_no_trainer_starts_on_a_lease_that_went_stale_during_the_stop(tmp_path, newer_during_the_stop):
    """Contact is lost while the old trainer checkpoints (its grace period): the next generation
    waits, fenced, until contact is back, instead of starting on GPUs the broker may reuse; also
    when a newer generation came during the stop (the launcher was left STOPPING, never fenced)."""
    shared = tmp_path / "job"
    shared.mkdir()
    trainer = tmp_path / "slow_stop.py"
    trainer.write_text("import signal, sys, time\n"
                       "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0)))\n"
                       "while True:\n    time.sleep(0.05)\n")
    launcher = Launcher(shared, f"{sys.executable} {trainer}", grace_s=5.0, poll_s=0.05)
    lease = {"contact_s": time.time(), "lease_s": 6.0, "fence_s": 1.2, "kill_s": 5.0, "generation": 1,
             "status": "running", "agent_pid": None}
    protocol.write_json(shared / protocol.LEASE, lease)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(launcher._run()), daemon=True)
    runner.start()
    try:
        wait_for(lambda: status(shared).get("state") == protocol.RUNNING, 30, "generation 1 to run")
        first = status(shared)["pid"]
        # the last contact: the new generation; the stop takes 1.5 s, past the fence at 1.2 s
        protocol.write_json(shared / protocol.LEASE, {**lease, "contact_s": time.time(), "generation": 2})
        protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [0, 1], "stop": False})
        if newer_during_the_stop:
            wait_for(lambda: status(shared).get("state") == protocol.STOPPING, 30, "the stop")
            protocol.write_json(shared / protocol.DESIRED, {"generation": 3, "gpus": [0, 1], "stop": False})
        wait_for(lambda: status(shared).get("state") == protocol.FENCED, 30, "the launcher to fence")
        assert not protocol.pid_alive(first) and status(shared)["pid"] is None
        assert "not starting generation 2" in (shared / protocol.LOG).read_text()
        gen = 3 if newer_during_the_stop else 2
        protocol.write_json(shared / protocol.LEASE, {**lease, "contact_s": time.time(), "generation": gen})
        wait_for(lambda: status(shared).get("state") == protocol.RUNNING and status(shared)["generation"] == gen,
                 30, "the newest generation to start once contact is back")
    finally:
        protocol.write_json(shared / protocol.DESIRED, {"generation": 3, "gpus": [0, 1], "stop": True})
        runner.join(30)


def test_a_stop_survives_a_generation_the_agent_writes_after_it(tmp_path):
    """A backend stops the job while the agent writes the generation it just read from the broker:
    ``desired.json`` has two writers, and the agent's write (``"stop": false``) erased the stop.
    The launcher then restarted the trainer on the new generation, and the stop SIGKILLed it at
    its timeout, without the SIGTERM that lets it checkpoint. The stop is kept in ``stop.json``."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} {checkpointing_trainer(tmp_path)}", grace_s=5.0, poll_s=0.05)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    with launcher_running(launcher) as (runner, done):
        wait_for(lambda: status(shared).get("state") == protocol.RUNNING, 30, "generation 1 to run")
        stops.request_stop(shared, "the task was killed")  # the backend's stop...
        protocol.write_json(shared / protocol.DESIRED,  # ...and the agent's generation, written after it
                            {"generation": 2, "gpus": [0, 1], "stop": False})
        runner.join(30)
        assert done == [0] and status(shared)["state"] == protocol.STOPPED
        assert status(shared)["generation"] == 1 and launcher.restarts == 0
        assert (tmp_path / "checkpointed").read_text() == "1"  # SIGTERM'd once, on generation 1
    stops.withdraw_stop(shared)  # a new launcher of the job (the next try) is not stopped by it
    assert not protocol.stop_requested(shared, protocol.read_json(shared / protocol.DESIRED))


def test_a_stop_during_a_resize_is_not_followed_by_the_new_generations_trainer(tmp_path):
    """The backend stops the job while the trainer checkpoints for a resize: the launcher started
    the new generation's trainer all the same, then stopped it with a second grace period (and the
    backend's SIGKILL at its timeout could cut that trainer's checkpoint)."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} {checkpointing_trainer(tmp_path, stop_s=1.0)}", grace_s=10.0,
                        poll_s=0.05)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    with launcher_running(launcher) as (runner, done):
        wait_for(lambda: status(shared).get("state") == protocol.RUNNING, 30, "generation 1 to run")
        protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [0, 1], "stop": False})
        wait_for(lambda: status(shared).get("state") == protocol.STOPPING, 30, "the resize's stop")
        stops.request_stop(shared, "the task was killed")
        runner.join(30)
        assert done == [0] and status(shared)["state"] == protocol.STOPPED
        assert (tmp_path / "checkpointed").read_text() == "1"
        assert "generation 2: starting" not in (shared / protocol.LOG).read_text()


def test_a_trainer_stopped_by_a_job_control_signal_still_gets_its_grace_period(tmp_path):
    """A trainer stopped with SIGSTOP (Ctrl-Z, a debugger) left its SIGTERM pending through the
    grace period and was SIGKILLed without its checkpoint."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} {checkpointing_trainer(tmp_path)}", grace_s=10.0, poll_s=0.05)
    launcher.generation = 1
    launcher._start({"generation": 1, "gpus": [0]})
    time.sleep(1.0)  # the handler is installed
    os.killpg(launcher.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    assert launcher._stop() == 0
    assert (tmp_path / "checkpointed").read_text() == "1" and time.monotonic() - started < 9


@pytest.mark.parametrize(("command", "code"), [
    ("{script}", 126),  # executable, but no shebang: "Exec format error"
    ("python -c 'unbalanced", 126),  # quoting shlex cannot split
    ("/no/such/trainer", 127),
    ("true", 126),  # in an ELASTIC_WORKDIR that does not exist
])
def test_a_trainer_that_cannot_be_started_is_an_exit_with_the_reason(tmp_path, command, code, monkeypatch):
    """A launcher that could not start its trainer for a reason other than "not found" died of a
    traceback, with ``status.json`` left at "starting": the agent then reported a dead launcher."""
    if command == "true":
        monkeypatch.setenv("ELASTIC_WORKDIR", str(tmp_path / "no-such-dir"))
    shared = tmp_path / "job"
    shared.mkdir()
    script = tmp_path / "train.sh"
    script.write_text("echo hello\n")
    script.chmod(0o755)
    launcher = Launcher(shared, command.format(script=script), grace_s=2.0, poll_s=0.05)
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    assert launcher._run() == code
    assert status(shared)["state"] == protocol.EXITED and status(shared)["exit_code"] == code
    assert "the trainer could not be started" in (shared / protocol.LOG).read_text()


def test_a_launcher_line_never_glues_onto_a_trainers_unfinished_line(tmp_path):
    """A trainer killed mid-line, or whose final metrics line has no newline: the launcher's next
    line starts on a line of its own, so the new generation's progress and the metrics still parse."""
    shared = tmp_path / "job"
    shared.mkdir()
    trainer = tmp_path / "t.py"
    trainer.write_text("import json, os, sys\n"
                       "gen = int(os.environ['ELASTIC_GENERATION'])\n"
                       "print(json.dumps({'step': 5 * gen}), flush=True)\n"
                       "sys.stdout.write(json.dumps({'final': True, 'accuracy': 0.9}) if gen == 2 else '{\"st')\n")
    launcher = Launcher(shared, f"{sys.executable} {trainer}", grace_s=2.0, poll_s=0.05)
    launcher.generation = 1
    launcher._start({"generation": 1, "gpus": [0]})
    launcher.proc.wait(30)
    launcher.proc = None  # as if stopped for the resize mid-line
    launcher.generation = 2
    launcher._start({"generation": 2, "gpus": [0, 1]})
    launcher.proc.wait(30)
    launcher._note("trainer exited with code 0")
    parser = LogParser()
    samples = list(parser.read(shared / protocol.LOG))
    assert samples == [(1, 5.0), (2, 10.0)] and parser.metrics == {"final": True, "accuracy": 0.9}
    assert '{"st\n' in (shared / protocol.LOG).read_text()  # the cut line ends where it was cut


def test_a_gang_node_whose_trainer_finished_first_is_not_a_dead_launcher(tmp_path):
    """A local gang: one node's trainer exits 0 (its launcher with it) while rank 0 still evaluates.
    That launcher reported its exit: the agent waits for the rest of the gang instead of killing
    rank 0 and failing the job ("the launcher died without reporting an exit")."""
    from test_sidecar import MovedOnBroker

    from airflow_elastic_gpu.sidecar.agent import Agent

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        shared = tmp_path / "job"
        for node, pid, state in (("node-a", alive.pid, protocol.RUNNING), ("node-b", finished.pid, protocol.EXITED)):
            d = shared / protocol.NODES / node
            d.mkdir(parents=True)
            protocol.write_json(d / protocol.STATUS, {"generation": 1, "state": state, "exit_code": 0,
                                                      "launcher_pid": pid})
        agent = Agent(MovedOnBroker(1), "j", shared, launcher_pid=[alive.pid, finished.pid])
        assert agent._launcher_gone() is None
        protocol.write_json(shared / protocol.NODES / "node-b" / protocol.STATUS,
                            {"generation": 1, "state": protocol.RUNNING, "launcher_pid": finished.pid})
        assert agent._launcher_gone() == finished.pid  # dead without a word: that is a dead launcher
    finally:
        alive.kill()
        alive.wait(5)


DIES_IN_GENERATION_1 = """
import os, sys, time
if os.environ["ELASTIC_GENERATION"] == "1":
    sys.exit(1)  # its peer node's trainer was stopped first: the rendezvous broke
time.sleep(60)
"""


@pytest.mark.parametrize(("nnodes", "next_generation", "restarted"), [
    (2, True, True),  # a gang's node: the exit was its peer's stop for the next generation
    (2, False, False),  # a gang's node, no next generation in time: a failure
    (1, True, False),  # one node: nothing stops before this launcher does, a failure
])
def test_a_gang_nodes_trainer_that_died_with_its_stopped_peer_restarts_on_the_next_generation(
        tmp_path, nnodes, next_generation, restarted):
    """Each node's launcher (or pod's agent) sees a gang's next generation at its own poll; a node
    whose trainer fails because a peer's was stopped first is restarted on that generation from
    its checkpoint, instead of failing the job."""
    script = tmp_path / "trainer.py"
    script.write_text(DIES_IN_GENERATION_1)
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} {script}", grace_s=2.0, poll_s=0.05, peer_wait_s=2.0)
    gang = {"nnodes": nnodes, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": 29500}
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False, **gang})
    launcher.generation = 1
    launcher._start(protocol.read_json(shared / protocol.DESIRED))
    launcher.proc.wait(30)  # it died; the next generation reaches this node a poll later
    if next_generation:
        threading.Timer(0.5, protocol.write_json, (shared / protocol.DESIRED,
                                                   {"generation": 2, "gpus": [1], "stop": False, **gang})).start()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(launcher._run()), daemon=True)
    runner.start()
    if restarted:
        wait_for(lambda: status(shared).get("state") == protocol.RUNNING and status(shared)["generation"] == 2,
                 10, "the trainer to restart on generation 2")
        assert launcher.restarts == 1 and "taken as that stop" in (shared / protocol.LOG).read_text()
        protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": True, **gang})
        runner.join(15)
        assert result == [0] and status(shared)["state"] == protocol.STOPPED
    else:
        runner.join(15)
        assert result == [1] and status(shared)["state"] == protocol.EXITED and status(shared)["exit_code"] == 1
        assert launcher.restarts == 0


def test_a_gang_node_waits_as_long_as_its_agents_lease_says_for_the_peers_generation(tmp_path):
    """A gang of pods: each pod's agent polls the broker (2 s) over HTTP (a 10 s timeout), so a
    node may see the next generation well after its peer's trainer was stopped. The agent's lease
    names that wait, longer than the launcher's own."""
    script = tmp_path / "trainer.py"
    script.write_text(DIES_IN_GENERATION_1)
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, f"{sys.executable} {script}", grace_s=2.0, poll_s=0.05, peer_wait_s=0.5)
    gang = {"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": 29500}
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False, **gang})
    periods = protocol.fence_periods(60.0)
    protocol.write_json(shared / protocol.LEASE, {
        "contact_s": time.time(), "lease_s": periods.lease_s, "fence_s": periods.fence_s,
        "kill_s": periods.kill_s, "generation": 1, "status": "running", "agent_pid": None, "peer_wait_s": 4.0})
    launcher.generation = 1
    launcher._start(protocol.read_json(shared / protocol.DESIRED))
    launcher.proc.wait(30)
    threading.Timer(1.5, protocol.write_json, (shared / protocol.DESIRED,
                                               {"generation": 2, "gpus": [1], "stop": False, **gang})).start()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(launcher._run()), daemon=True)
    runner.start()
    wait_for(lambda: status(shared).get("state") == protocol.RUNNING and status(shared)["generation"] == 2,
             10, "the trainer to restart on generation 2")
    assert launcher.restarts == 1 and "taken as that stop" in (shared / protocol.LOG).read_text()
    protocol.write_json(shared / protocol.DESIRED, {"generation": 2, "gpus": [1], "stop": True, **gang})
    runner.join(15)
    assert result == [0]


def test_a_process_whose_name_the_kernel_cut_inside_a_utf8_character_is_seen_alive():
    """``/proc/<pid>/stat`` holds the command name cut to 15 bytes, through a multi-byte character
    if it must; read as UTF-8 text it raised, and a live trainer process was taken for gone
    (``proc_stat`` None, ``descendants`` without it) or ``pid_alive`` raised."""
    import os

    code = ("import sys, time; open('/proc/self/comm', 'wb').write('é'.encode() * 8); "
            "print('named', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "named"
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"\xc3)" in f.read(), "the name is not cut inside a character"
        assert protocol.pid_alive(child.pid)
        state, start = protocol.proc_stat(child.pid)
        assert state in "RS" and start > 0
        assert child.pid in protocol.descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert not protocol.pid_alive(child.pid) and protocol.proc_stat(child.pid) is None


@pytest.mark.parametrize("trainer", ["exits by itself", "still runs"])
def test_the_watchdog_fences_only_a_trainer_it_killed(tmp_path, trainer):
    """The launcher's loop was blocked (a hung shared directory) and the lease it read last is past
    kill_s. A trainer that exited by itself meanwhile (code 0, not reaped yet) is reported as that
    exit once the loop is back: the watchdog marked it too, and the loop took the success for a
    fence, which the agent would have restarted. A trainer still running is SIGKILLed and fenced."""
    shared = tmp_path / "job"
    shared.mkdir()
    launcher = Launcher(shared, "true", poll_s=0.05)
    now = time.time()
    launcher.lease.update({"contact_s": now - 3.5, "lease_s": 4.0, "fence_s": 2.0, "kill_s": 3.0}, now, time.monotonic())
    launcher.generation = 1
    command = "exit 0" if trainer == "exits by itself" else "sleep 60"
    launcher.proc = subprocess.Popen(["sh", "-c", command], start_new_session=True)
    launcher.proc_start = protocol.proc_stat(launcher.proc.pid)[1]
    if trainer == "exits by itself":
        wait_for(lambda: protocol.proc_stat(launcher.proc.pid)[0] == "Z", 10, "the trainer to exit")
    threading.Thread(target=launcher._watchdog, daemon=True).start()
    time.sleep(0.3)  # a few watchdog rounds
    assert (launcher.watchdog_killed is launcher.proc) == (trainer == "still runs")
    protocol.write_json(shared / protocol.LEASE, {"contact_s": time.time(), "lease_s": 4.0, "fence_s": 2.0,
                                                  "kill_s": 3.0})  # contact is back
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    threading.Thread(target=launcher._run, daemon=True).start()
    if trainer == "exits by itself":
        done = wait_for(lambda: (s := status(shared)).get("state") == protocol.EXITED and s, 10, "the exit")
        assert done["exit_code"] == 0 and done["fences"] == 0
    else:
        fenced = wait_for(lambda: (s := status(shared)).get("state") == protocol.FENCED and s, 10, "the fence")
        assert fenced["fences"] == 1 and launcher.proc is None
