"""The local backend's processes under races and reuse: two starts of one job at once, a stop
during a start (from another thread, from the start's own thread, from a thread waiting for its
lock), a start or restart killed before it recorded its processes, a start that failed, a pid of a
trainer that ended taken by another process since, a dead launcher's orphan trainer, a clean exit
its agent did not report, and a stop left in ``desired.json`` by an earlier try."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_local_backend import local  # noqa: F401 - a fixture
from test_sidecar import wait_for

from airflow_elastic_gpu.backends import BackendError
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.backends.local_processes import JOB_MARK, LocalHandle, boot_id, start_ticks
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.watcher import GONE_POLLS, CleanupFailed, JobWatcher

SLEEPER = f"{sys.executable} -c 'import time; time.sleep(60)'"


def marked(job_id: str | None) -> list[int]:
    """Live processes whose environment carries ``job_id``'s mark."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"{JOB_MARK}={job_id}".encode() in environ.split(b"\0") and protocol.pid_alive(int(entry)):
            out.append(int(entry))
    return out


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_two_starts_of_one_job_at_once_start_one_agent_and_one_launcher(local):  # noqa: F811
    """Both see no handle yet (a trigger in two triggerers for a moment, a cleared task's new try):
    each started a launcher, an agent and a trainer of its own on the job's GPUs."""
    broker, backend = local
    job = broker.submit(JobSpec("twice", SLEEPER, 1, 1, total_steps=10))
    refs: list[str] = []
    threads = [threading.Thread(target=lambda: refs.append(backend.start(job))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(refs) == 2 and refs[0] == refs[1]
    procs = marked(job.id)
    agents = [p for p in procs if "sidecar.agent" in command_of(p)]
    launchers = [p for p in procs if "sidecar.launcher" in command_of(p)]
    assert len(agents) == 1 and len(launchers) == 1


def test_a_stop_during_a_start_stops_the_processes_that_start_makes(local):  # noqa: F811
    """A stop (a task's ``on_kill``) while a start of the job runs (its trigger in another
    triggerer) read no handle yet and returned: the launcher and agent the start spawned next ran
    on, a trainer on GPUs the task's end was to free."""
    broker, backend = local
    job = broker.submit(JobSpec("raced", SLEEPER, 1, 1, total_steps=10))
    spawned, stopping = threading.Event(), threading.Event()
    start_launchers = backend._start_launchers

    def slow_start_launchers(*args, **kwargs):
        out = start_launchers(*args, **kwargs)
        spawned.set()
        stopping.wait(10)  # the stop is called now, before the start has written handle.json
        time.sleep(0.5)
        return out

    backend._start_launchers = slow_start_launchers
    starter = threading.Thread(target=lambda: backend.start(job))
    starter.start()
    assert spawned.wait(60)
    stopper = threading.Thread(target=lambda: backend.stop(job.id, timeout_s=10))
    stopper.start()
    stopping.set()
    starter.join(60)
    stopper.join(60)
    wait_for(lambda: not marked(job.id), 10, "the job's processes to be gone")


def test_a_stop_signals_no_pid_of_a_trainer_that_ended_and_no_reused_one(local, tmp_path):  # noqa: F811
    """``status.json`` keeps an ended trainer's pid (state ``exited``), and a running one's with its
    start time: another process of this user that has the pid now (no job mark: it could have been
    the job's) is not SIGKILLed by the stop, as it was."""
    broker, backend = local
    job = broker.submit(JobSpec("reused", SLEEPER, 1, 1, total_steps=10))
    job_dir = backend.job_dir(job.id)
    job_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != JOB_MARK}
    strangers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                                  env=env) for _ in range(2)]
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        protocol.write_json(job_dir / "handle.json", {"job_dir": str(job_dir), "agent_pid": dead.pid,
                                                      "launcher_pid": dead.pid, "boot_id": boot_id()})
        exited, reused = strangers
        for status in ({"state": protocol.EXITED, "generation": 1, "pid": exited.pid, "exit_code": 0,
                        "pid_start": start_ticks(exited.pid), "workers": []},
                       {"state": protocol.RUNNING, "generation": 1, "pid": reused.pid,
                        "pid_start": start_ticks(reused.pid) - 1, "workers": [exited.pid],
                        "worker_starts": [start_ticks(exited.pid) - 1]}):
            protocol.write_json(job_dir / protocol.STATUS, status)
            backend.stop(job.id, timeout_s=1)
            assert exited.poll() is None and reused.poll() is None
    finally:
        for p in strangers:
            p.kill()
            p.wait()


def _running_then_killed(broker, backend, name: str, gpus: int, *, trainer_too: bool):
    """A job started on ``gpus`` GPUs whose trainer runs, then its agent and launcher (and with
    ``trainer_too`` its trainer) SIGKILLed, as a host's OOM killer might: the job and the trainer's
    last ``status.json``."""
    job = broker.submit(JobSpec(name, SLEEPER, gpus, gpus, total_steps=10))
    job = broker.start(job.id, backend.start(job))
    status = wait_for(lambda: (s := protocol.read_json(backend.job_dir(job.id) / protocol.STATUS) or {}).get(
        "state") == protocol.RUNNING and s, 30, "the trainer")
    broker.ack(job.id, 1)
    h = backend.handle(job.id)
    for pid in (h.agent_pid, h.launcher_pid, *([status["pid"]] if trainer_too else [])):
        os.kill(pid, 9)
    wait_for(lambda: not backend.is_running(job.id), 10, "the agent and launcher to be gone")
    return job, status


def test_a_dead_launchers_orphan_trainer_keeps_the_jobs_gpu_until_it_is_killed(local):  # noqa: F811
    """The agent and the launcher are killed (the OOM killer), the trainer runs on in its session:
    the watcher fails the job with its GPU held (it went to the next job at once, while the
    orphan, perhaps stuck in the kernel, still ran on it), and the stop that follows kills the
    orphan and frees the GPU."""
    broker, backend = local
    job, status = _running_then_killed(broker, backend, "orphan", 2, trainer_too=False)
    assert backend.problem(broker.job(job.id)).running
    watcher = JobWatcher(broker, backend, job.id)
    stop = backend.stop
    backend.stop = lambda *a, **k: (_ for _ in ()).throw(OSError("stuck in the kernel"))  # it cannot kill it yet
    for _ in range(GONE_POLLS - 1):
        watcher.poll()
    with pytest.raises(CleanupFailed):
        watcher.poll()
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and "processes are gone" in failed.reason
    assert len(failed.in_use_gpus) == 2 and protocol.pid_alive(status["pid"])  # held while the orphan runs
    backend.stop = stop
    watcher.poll()  # the stop kills the orphan and tells the broker
    assert not protocol.pid_alive(status["pid"])
    assert broker.job(job.id).in_use_gpus == ()


def test_a_stop_left_in_desired_json_by_an_earlier_try_does_not_end_the_new_launcher(local):  # noqa: F811
    """A try stopped the job's processes but could not cancel the job (the broker away); the next
    try starts a launcher again, which read the old ``stop`` and exited at once: the job then failed
    as "stopped from outside the broker"."""
    broker, backend = local
    job = broker.submit(JobSpec("restarted", SLEEPER, 1, 1, total_steps=10))
    job = broker.start(job.id, backend.start(job))
    # what the try's stop leaves: its processes gone, "stop" in desired.json. (A real stop races
    # the agent, which may report the launcher's exit first: the job is then failed, not reattached)
    os.kill(backend.handle(job.id).agent_pid, 9)
    desired = backend.job_dir(job.id) / protocol.DESIRED
    protocol.write_json(desired, {**(protocol.read_json(desired) or {"generation": 0, "gpus": []}), "stop": True})
    backend.stop(job.id, timeout_s=10)
    assert protocol.read_json(desired)["stop"] is True and broker.job(job.id).status is JobStatus.RUNNING
    backend.start(broker.job(job.id))  # the next try reattaches
    time.sleep(2.0)  # several launcher polls
    h = backend.handle(job.id)
    assert h.owns(h.launcher_pid) and not protocol.stop_requested(
        backend.job_dir(job.id), protocol.read_json(backend.job_dir(job.id) / protocol.DESIRED))
    assert broker.job(job.id).status is JobStatus.RUNNING


def test_the_trainer_numbers_gpus_as_nvidia_smi_does(local, tmp_path):  # noqa: F811
    """The broker's GPU indices are nvidia-smi's (PCI bus order); CUDA's default order is fastest
    first, so on a host of mixed GPUs index 0 was another GPU (a drained one handed out again)."""
    broker, backend = local
    job = broker.submit(JobSpec("order", f"{sys.executable} -c \"import os; print(os.environ['CUDA_DEVICE_ORDER'])\"",
                                1, 1, total_steps=1))
    job = broker.start(job.id, backend.start(job))
    wait_for(lambda: broker.job(job.id).status.terminal, 60, "the job to end")
    assert "PCI_BUS_ID" in LocalBackend.log_tail(backend, job.id)


def test_a_start_killed_before_it_recorded_its_processes_is_not_followed_by_a_second_trainer(local):  # noqa: F811
    """The worker is killed (OOM) after the start spawned the launcher and the agent, before it
    wrote ``handle.json``: the next try's start saw no handle and started a second launcher,
    agent and trainer on the job's GPUs and checkpoint."""
    broker, backend = local
    job = broker.submit(JobSpec("interrupted", SLEEPER, 1, 1, total_steps=10))
    backend.start(job)
    wait_for(lambda: len(marked(job.id)) >= 3, 30, "the agent, the launcher and the trainer")
    first = set(marked(job.id))
    (backend.job_dir(job.id) / "handle.json").unlink()  # never written
    backend.start(broker.job(job.id))
    wait_for(lambda: not first & set(marked(job.id)), 10, "the unrecorded processes to be gone")
    procs = marked(job.id)
    assert len([p for p in procs if "sidecar.agent" in command_of(p)]) == 1
    assert len([p for p in procs if "sidecar.launcher" in command_of(p)]) == 1


@pytest.mark.parametrize("stuck", [False, True])
def test_a_start_that_fails_after_it_spawned_frees_the_gpus_only_once_nothing_of_it_runs(local, monkeypatch,  # noqa: F811
                                                                                         stuck):
    """``handle.json`` cannot be written (a full disk) after the launcher and the agent were
    spawned: the job was failed with its GPUs freed at once, for another job, while they ran on,
    and the stop that followed, finding no handle, left them running."""
    from airflow_elastic_gpu.backends.base import start_job

    broker, backend = local
    job = broker.submit(JobSpec("full-disk", SLEEPER, 2, 2, total_steps=10))
    assert len(broker.job(job.id).target_gpus) == 2
    write_json = protocol.write_json
    released_while_running: list[list[int]] = []

    def full_disk(path, data):
        if Path(path).name == "handle.json":
            raise OSError(28, "No space left on device")
        return write_json(path, data)

    fail = broker.fail

    def watched_fail(job_id, *args, **kwargs):
        ended = fail(job_id, *args, **kwargs)
        if not ended.target_gpus and not ended.in_use_gpus and (alive := marked(job_id)):
            released_while_running.append(alive)
        return ended

    monkeypatch.setattr(protocol, "write_json", full_disk)
    monkeypatch.setattr(broker, "fail", watched_fail)
    if stuck:  # processes that outlive SIGKILL (stuck in the kernel): the GPUs stay held (for the lease)
        monkeypatch.setattr(protocol, "survivors", lambda pids, *a, **k: list(pids))
    with pytest.raises(OSError, match="No space left"):
        start_job(broker, backend, job)
    ended = broker.job(job.id)
    assert ended.status is JobStatus.FAILED and "No space left" in ended.reason
    assert released_while_running == []
    if stuck:
        assert len(ended.target_gpus) == 2
        return
    assert marked(job.id) == [] and ended.target_gpus == () and ended.in_use_gpus == ()


def test_a_start_that_fails_before_it_spawned_anything_frees_the_gpus_at_once(local):  # noqa: F811
    """No Python to run the launcher: the failed job's GPUs stayed held for the pool's lease."""
    from airflow_elastic_gpu.backends.base import start_job

    broker, local_backend = local
    backend = LocalBackend(local_backend.work_dir, broker, python="/nonexistent/python")
    job = broker.submit(JobSpec("no-python", SLEEPER, 2, 2, total_steps=10))
    with pytest.raises(BackendError):
        start_job(broker, backend, job)
    ended = broker.job(job.id)
    assert ended.status is JobStatus.FAILED and ended.target_gpus == () and ended.in_use_gpus == ()


def test_a_clean_exit_that_its_agent_did_not_live_to_report_is_a_success(local):  # noqa: F811
    """The trainer exits 0 (its launcher records it), and the agent is killed before it reports
    the end (or gives up on a broker away for ten minutes): the watcher found the processes gone
    and failed the job, whose trainer had finished, and the task's retry trained it again."""
    broker, backend = local
    job, status = _running_then_killed(broker, backend, "finished", 1, trainer_too=True)
    # what the launcher had recorded of a trainer that exited by itself, and its last lines
    protocol.write_json(backend.job_dir(job.id) / protocol.STATUS, {**status, "state": protocol.EXITED,
                                                                     "exit_code": 0})
    with open(backend.log_path(job.id), "a") as log:
        log.write('{"step": 10}\n{"final": true, "step": 10, "accuracy": 0.97}\n')
    watcher = JobWatcher(broker, backend, job.id)
    for _ in range(GONE_POLLS):
        ended, _ = watcher.poll()
    assert ended.status is JobStatus.SUCCEEDED and ended.metrics == {"final": True, "step": 10, "accuracy": 0.97}
    assert ended.in_use_gpus == () and ended.exit_code == 0


@pytest.mark.parametrize("then", ["start", "stop"])
def test_a_restart_killed_before_it_recorded_its_processes_leaves_no_second_set(local, monkeypatch, then):  # noqa: F811
    """The job's agent and launcher died; a retry's start spawned new ones and was killed (or its
    disk was full) before it rewrote ``handle.json``, which still named the dead ones: the next
    start spawned a second launcher and agent beside them, and a stop killed only what the handle
    named."""
    broker, backend = local
    job = broker.submit(JobSpec("restarted", SLEEPER, 1, 1, total_steps=10))
    backend.start(job)
    h = backend.handle(job.id)
    for pid in (h.agent_pid, h.launcher_pid):
        os.kill(pid, 9)
    wait_for(lambda: not backend.is_running(job.id), 10, "the agent and the launcher to be gone")
    write_json = protocol.write_json

    def full_disk(path, data):
        if Path(path).name == "handle.json":
            raise OSError(28, "No space left on device")
        return write_json(path, data)

    monkeypatch.setattr(protocol, "write_json", full_disk)
    with pytest.raises(OSError):
        backend.start(broker.job(job.id))
    monkeypatch.setattr(protocol, "write_json", write_json)
    strays = set(marked(job.id))
    assert strays
    if then == "stop":
        backend.stop(job.id, timeout_s=2)
        assert not marked(job.id)  # killed by the stop, not left to see the stop in desired.json
        return
    backend.start(broker.job(job.id))
    wait_for(lambda: not strays & set(marked(job.id)), 10, "the unrecorded processes to be gone")
    procs = marked(job.id)
    assert len([p for p in procs if "sidecar.agent" in command_of(p)]) == 1
    assert len([p for p in procs if "sidecar.launcher" in command_of(p)]) == 1


def test_a_stop_from_the_thread_that_is_starting_the_job_does_not_wait_for_itself(local):  # noqa: F811
    """Airflow calls a task's on_kill from its SIGTERM handler, in the thread that may be inside the
    job's start, holding the start lock: the stop waited for that lock, held by its own thread,
    for START_LOCK_TIMEOUT_S (120 s), and the supervisor's SIGKILL came first."""
    broker, backend = local
    job = broker.submit(JobSpec("killed-while-starting", SLEEPER, 1, 1, total_steps=10))
    start_launchers, waited = backend._start_launchers, []

    def sigterm_while_starting(*args, **kwargs):
        out = start_launchers(*args, **kwargs)
        began = time.monotonic()
        backend.stop(job.id, timeout_s=2)  # the task's on_kill, in this thread
        waited.append(time.monotonic() - began)
        return out

    backend._start_launchers = sigterm_while_starting
    with pytest.raises(BackendError, match="stopped while it started"):  # nothing of it left running
        backend.start(job)
    assert waited[0] < 30
    assert marked(job.id) == []  # the launcher killed by the stop, the agent spawned after it by the start


def test_a_stop_while_its_thread_waits_for_the_start_lock_stops_the_job_without_it(local, monkeypatch):  # noqa: F811
    """on_kill's stop from the signal handler of a thread that waits for the job's start lock (another
    process starts the job): filelock refuses the nested acquire (RuntimeError), which escaped the
    stop, so nothing was stopped and the start that got the lock next ran the job on."""
    from airflow_elastic_gpu.backends import local as local_module
    from airflow_elastic_gpu.backends.local_processes import STOPPED_WHILE_STARTING

    broker, backend = local
    job = broker.submit(JobSpec("waiting", SLEEPER, 1, 1, total_steps=10))
    backend.start(job)
    assert backend.is_running(job.id)

    class Waited:
        def acquire(self):
            raise RuntimeError("Deadlock: the lock is acquired again while this thread's acquire of it waits")

    monkeypatch.setattr(local_module, "start_lock", lambda job_dir: Waited())
    backend.stop(job.id, timeout_s=2)
    assert not backend.is_running(job.id) and job.id in STOPPED_WHILE_STARTING  # the waiting start fails next


def test_a_stop_without_the_jobs_directory_frees_no_gpus_of_a_job_started_elsewhere(tmp_path):
    """A stop in a process whose work_dir is another's (another AIRFLOW_HOME) finds no job
    directory: it freed the GPUs of the cancelled job, whose trainer may still run elsewhere."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("elsewhere", SLEEPER, 2, 2, total_steps=10))
    broker.start(job.id, '{"job_dir": "/elsewhere"}')
    broker.cancel(job.id)
    LocalBackend(tmp_path / "other-jobs", broker).stop(job.id)
    assert len(broker.job(job.id).target_gpus) == 2  # held until its trainer is known stopped


def test_a_recorded_process_of_another_user_is_the_jobs_and_an_unknown_one_is_not(monkeypatch):
    """With ``run_as_user`` the job's processes are another user's, whose environment the triggerer
    cannot read: the recorded process (its start time matches) is still the job's, so the job is
    not taken for gone and its GPUs freed while its trainer runs. A pid of unknown start time whose
    environment cannot be read is not (it may be a reused pid)."""
    from airflow_elastic_gpu.backends import local_processes

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = local_processes.start_ticks(proc.pid)
        assert ticks is not None
        real = Path.read_bytes

        def unreadable(path):
            if str(path) == f"/proc/{proc.pid}/environ":
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(Path, "read_bytes", unreadable)
        assert local_processes.job_process(proc.pid, "job-1", started=ticks)
        assert not local_processes.job_process(proc.pid, "job-1", started=ticks + 1)  # another process has the pid
        assert not local_processes.job_process(proc.pid, "job-1")  # start time not recorded
    finally:
        proc.kill()
        proc.wait()


def test_a_job_started_from_another_work_directory_is_not_started_again(local, tmp_path):  # noqa: F811
    """``run-local --key K`` (or a worker) whose work directory differs from the one the key's
    running job was started from found no handle of it: it killed the job's processes as strays
    and trained it again from an empty checkpoint directory, saying "not started again". The start
    is refused, naming the job's directory, and the job runs on; so is one of another backend's job."""
    from airflow_elastic_gpu.backends.base import start_job

    broker, backend = local
    job = broker.submit(JobSpec("elsewhere", SLEEPER, 1, 1, total_steps=10, key="k"))
    job = start_job(broker, backend, job)
    wait_for(lambda: backend.handle(job.id) is not None and len(marked(job.id)) >= 2, 60, "the job to start")
    running = set(marked(job.id))
    other = LocalBackend(tmp_path / "another-work-dir", broker)
    again = broker.submit(JobSpec("elsewhere", SLEEPER, 1, 1, total_steps=10, key="k"))  # the key's job
    assert again.id == job.id and again.token is None
    with pytest.raises(BackendError, match=f"started in job directory {backend.job_dir(job.id)}, not "):
        start_job(broker, other, again)
    assert running <= set(marked(job.id)) and broker.job(job.id).status is JobStatus.RUNNING
    assert not other.job_dir(job.id).exists()
    assert backend.start(broker.job(job.id)) == broker.job(job.id).backend_ref  # its own: idempotent

    pod = broker.submit(JobSpec("pod", SLEEPER, 1, 1, total_steps=10))
    broker.start(pod.id, "elastic-gpu-0123-g1")  # a Kubernetes pod's name
    with pytest.raises(BackendError, match="was started by another backend than this local one"):
        backend.start(broker.job(pod.id))


def test_a_relative_work_directory_is_recorded_as_an_absolute_one(local, tmp_path, monkeypatch):  # noqa: F811
    """``run-local --work-dir jobs`` recorded ``jobs/<id>`` in the job's reference, which then named
    another directory from another working directory: the same relative path there passed the
    check above (and killed the job's processes as strays), its absolute spelling was refused."""
    broker, _ = local
    monkeypatch.chdir(tmp_path)
    backend = LocalBackend("jobs", broker)
    assert backend.work_dir == tmp_path / "jobs"
    job = broker.submit(JobSpec("relative", SLEEPER, 1, 1, total_steps=10))
    job = broker.start(job.id, backend.start(job))
    assert LocalHandle.from_ref(job.backend_ref).job_dir == tmp_path / "jobs" / job.id
    (tmp_path / "elsewhere" / "jobs").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(BackendError, match="started in job directory"):
        LocalBackend("jobs", broker).start(broker.job(job.id))
    assert LocalBackend(tmp_path / "jobs", broker).start(broker.job(job.id)) == broker.job(job.id).backend_ref
    backend.stop(job.id, timeout_s=10)
