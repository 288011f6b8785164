"""The local backend keeps its secrets and never half-starts a job, with real processes.

Secrets: the broker URL is not on any process's command line (``ps`` shows those to every user),
trainers inherit neither the broker URL nor Airflow's secrets, job files are private, printed URLs
are masked. Starts: a job that cannot be started is refused before it is submitted, or failed at
once with the reason, its GPUs freed and nothing left running.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import local_backend
from test_sidecar import wait_for

from airflow_elastic_gpu import cli
from airflow_elastic_gpu.backends.base import BackendError, start_job
from airflow_elastic_gpu.backends.local import LocalBackend, trainer_environment
from airflow_elastic_gpu.broker.db import create_broker_engine
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.config import mask_url
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.submit import submit_and_start

PRINT_ENV = "import json, os\nprint(json.dumps({'environ': dict(os.environ)}), flush=True)\n"
SECRET = "hunter2-not-for-trainers"


@pytest.fixture
def local(tmp_path):
    """A broker (SQLite) with 2 GPUs, and a local backend whose job directories are under ``jobs/``."""
    yield from local_backend(tmp_path, gpus=2, grace_s=5, stop_timeout_s=10)


def run_job(broker: GpuBroker, backend: LocalBackend, command: str, **env: str):
    job = broker.submit(JobSpec("j", command, 1, 1, total_steps=1))
    start_job(broker, backend, job, env=env)
    return job, backend.handle(job.id)


def ended(broker: GpuBroker, job_id: str):
    return wait_for(lambda: broker.job(job_id).status.terminal and broker.job(job_id), 60, "the job to end")


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_broker_url_is_on_no_command_line_of_the_job(local, tmp_path):
    broker, backend = local
    backend.grace_s = 100.0  # the agent's stop waits it out (it waited 60 s, then left the job to its lease)
    job, handle = run_job(broker, backend, "sleep 600")
    assert "--stop-timeout-s 110.0" in cmdline(handle.agent_pid) and "--grace-s 100.0" in cmdline(handle.launcher_pid)
    trainer = wait_for(lambda: (protocol.read_json(handle.job_dir / protocol.STATUS) or {}).get("pid"), 30,
                       "the trainer to start")
    for pid in (handle.agent_pid, handle.launcher_pid, trainer):  # what `ps -ef` shows to every user
        shown = cmdline(pid)
        assert broker.url not in shown and "broker.db" not in shown and "--broker-url" not in shown, shown
    agent_environ = Path(f"/proc/{handle.agent_pid}/environ").read_bytes().split(b"\0")
    assert f"AIRFLOW_ELASTIC_GPU_BROKER_URL={broker.url}".encode() in agent_environ  # how it gets it
    assert stat.S_IMODE(os.stat(f"/proc/{handle.agent_pid}/environ").st_mode) == 0o400  # its owner's only
    broker.cancel(job.id)
    assert ended(broker, job.id).status is JobStatus.CANCELLED


def test_a_trainer_inherits_neither_the_broker_url_nor_airflows_secrets(local, tmp_path, monkeypatch):
    broker, backend = local
    for name in ("AIRFLOW_ELASTIC_GPU_BROKER_URL", "AIRFLOW_ELASTIC_GPU_JOB_TOKEN", "AIRFLOW_CONN_WAREHOUSE",
                 "AIRFLOW_VAR_API_KEY", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__FERNET_KEY"):
        monkeypatch.setenv(name, f"postgresql://airflow:{SECRET}@db/{name}")
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", broker.url)
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV)
    job, handle = run_job(broker, backend, f"{sys.executable} {script}", WANTED="by the job",
                          AIRFLOW_CONN_PASSED="explicitly")
    assert ended(broker, job.id).status is JobStatus.SUCCEEDED
    log = (handle.job_dir / protocol.LOG).read_text()
    environ = next(json.loads(line)["environ"] for line in log.splitlines() if line.startswith('{"environ"'))
    assert SECRET not in log and broker.url not in log and "broker.db" not in log
    leaked = [k for k in environ if k.startswith(("AIRFLOW_ELASTIC_GPU_", "AIRFLOW_VAR_", "AIRFLOW__"))]
    assert leaked == []
    assert environ["WANTED"] == "by the job" and environ["AIRFLOW_CONN_PASSED"] == "explicitly"  # env= is kept
    assert environ["PATH"] == os.environ["PATH"] and environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_trainer_environment_drops_credentials_and_keeps_the_rest():
    environ = {"PATH": "/bin", "HOME": "/home/u", "AIRFLOW_HOME": "/opt/airflow", "AIRFLOW_CONN_X": "s",
               "AIRFLOW_VAR_Y": "s", "AIRFLOW__CORE__FERNET_KEY": "s", "AIRFLOW_ELASTIC_GPU_BROKER_URL": "s"}
    assert trainer_environment(environ, {"A": "1"}) == {"PATH": "/bin", "HOME": "/home/u",
                                                        "AIRFLOW_HOME": "/opt/airflow", "A": "1",
                                                        "OMP_NUM_THREADS": "1"}


def test_job_directories_are_0700_and_logs_and_files_0600(local, tmp_path):
    broker, backend = local
    job, handle = run_job(broker, backend, "true")
    assert ended(broker, job.id).status is JobStatus.SUCCEEDED

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(tmp_path / "jobs") == 0o700  # created by the backend
    assert mode(handle.job_dir) == 0o700
    for name in ("agent.log", "launcher.log", protocol.LOG, "handle.json", protocol.STATUS, protocol.DESIRED):
        assert mode(handle.job_dir / name) == 0o600, name


def test_an_existing_job_directory_is_made_private_again(local):
    broker, backend = local
    job = broker.submit(JobSpec("j", "true", 1, 1, total_steps=1))
    backend.job_dir(job.id).mkdir(parents=True, mode=0o755)
    (backend.job_dir(job.id) / protocol.LOG).write_text("an old log\n")
    os.chmod(backend.job_dir(job.id), 0o755)
    os.chmod(backend.job_dir(job.id) / protocol.LOG, 0o644)
    start_job(broker, backend, job)
    assert stat.S_IMODE(os.stat(backend.job_dir(job.id)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(backend.job_dir(job.id) / protocol.LOG).st_mode) == 0o600
    ended(broker, job.id)


def test_a_new_sqlite_broker_file_is_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "broker.db"
    broker = GpuBroker(f"sqlite:///{path}")
    broker.register_node("n", 1)  # a write: the WAL file exists now
    for p in (path, Path(f"{path}-wal")):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    broker.engine.dispose()


@pytest.mark.parametrize("url", ["postgresql+psycopg://airflow:hunter2@db:5432/broker",
                                 "postgresql://airflow:hunter2@db:not-a-port/broker",
                                 "not a url ://airflow:hunter2@db"])
def test_urls_are_masked_wherever_they_are_shown(url, capsys, monkeypatch):
    assert "hunter2" not in mask_url(url) and "***" in mask_url(url)
    try:
        create_broker_engine(url)
    except Exception as exc:  # noqa: BLE001 - only its message matters here
        assert "hunter2" not in str(exc)
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("served a database it cannot use"))
    monkeypatch.setattr(cli, "CLI_RECONNECT_DEADLINE_S", 0.5)
    assert cli.main(["--broker-url", url, "broker", "serve"]) == 2  # refused before it listens
    out = capsys.readouterr()
    assert "hunter2" not in out.out + out.err and "error:" in out.err


# --------------------------------------------------------------------------- atomic starts


def run_local(broker: GpuBroker, tmp_path: Path, *extra: str) -> int:
    return cli.main(["--broker-url", broker.url, "run-local", "--total-steps", "5", "--detach",
                     "--work-dir", str(tmp_path / "jobs"), *extra, "--", "true"])


def test_run_local_renames_the_default_checkpoint_directory_of_its_success(local, tmp_path, capsys):
    """As the operator does: a later run of the same key trains anew rather than resuming at the
    final step of the one that succeeded."""
    broker, _ = local
    trainer = tmp_path / "train.py"
    trainer.write_text("import json, os, pathlib\n"
                       "pathlib.Path(os.environ['ELASTIC_CHECKPOINT_DIR'], 'ckpt').write_text('5')\n"
                       "print(json.dumps({'step': 5}), flush=True)\n")
    assert cli.main(["--broker-url", broker.url, "run-local", "--total-steps", "5", "--key", "nightly/train",
                     "--work-dir", str(tmp_path / "jobs"), "--", sys.executable, str(trainer)]) == 0
    (job,) = broker.jobs()
    assert job.status is JobStatus.SUCCEEDED
    (kept,) = (tmp_path / "jobs" / "checkpoints").glob(f"nightly_train-*@{job.id}")
    assert (kept / "ckpt").read_text() == "5"
    assert sorted(p.name for p in (tmp_path / "jobs" / "checkpoints").iterdir()) == [".lock", kept.name]


def test_a_detached_success_s_checkpoint_is_renamed_when_the_next_run_of_its_key_starts(local, tmp_path):
    """``run-local --detach`` does not wait for the job's end, so nothing renames its checkpoint
    directory then: the next job of the key renames it when it claims the directory, and trains anew."""
    broker, _ = local
    trainer = tmp_path / "train.py"
    trainer.write_text("import json, os, pathlib\n"
                       "ckpt = pathlib.Path(os.environ['ELASTIC_CHECKPOINT_DIR'], 'ckpt')\n"
                       "print(json.dumps({'resumed': ckpt.exists()}), flush=True)\n"
                       "ckpt.write_text('5')\n"
                       "print(json.dumps({'step': 5}), flush=True)\n")
    run = ["--broker-url", broker.url, "run-local", "--total-steps", "5", "--key", "nightly/train",
           "--work-dir", str(tmp_path / "jobs"), "--", sys.executable, str(trainer)]
    assert cli.main([*run[:2], run[2], "--detach", *run[3:]]) == 0
    (first,) = broker.jobs()
    wait_for(lambda: broker.job(first.id).status.terminal, 60, "the detached job to end")
    assert broker.job(first.id).status is JobStatus.SUCCEEDED
    assert cli.main(run) == 0
    second = next(j for j in broker.jobs() if j.id != first.id)
    assert '{"resumed": false}' in (tmp_path / "jobs" / second.id / "train.log").read_text()
    (kept,) = (tmp_path / "jobs" / "checkpoints").glob(f"nightly_train-*@{first.id}")
    assert (kept / "ckpt").read_text() == "5"


def test_run_local_says_when_its_key_names_a_job_submitted_before(local, tmp_path, capsys):
    """A second ``run-local --key K`` while K's job runs gets that job (submit is idempotent on the
    key): it printed "job ... started" as if it had started another."""
    broker, _ = local
    run = ["--broker-url", broker.url, "run-local", "--detach", "--total-steps", "5", "--key", "k1",
           "--work-dir", str(tmp_path / "jobs"), "--", "sleep", "60"]
    assert cli.main(run) == 0
    (job,) = broker.jobs()
    assert f"job {job.id} started" in capsys.readouterr().out
    try:
        assert cli.main(run) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"job {job.id} of key 'k1' was submitted before and is running" in out
        assert f"job {job.id} started" not in out
        assert len(broker.jobs()) == 1
    finally:
        broker.cancel(job.id)  # the fixture stops its processes


def test_a_run_whose_log_never_matched_the_progress_pattern_says_so(local, tmp_path, capsys):
    """It succeeded at step 0 of 50 without a word: the broker had measured nothing of it."""
    broker, _ = local
    run = ["--broker-url", broker.url, "run-local", "--total-steps", "50", "--progress-pattern", r"iter (\d+)",
           "--work-dir", str(tmp_path / "jobs"), "--", sys.executable, "-c", "print('epoch 1 of 1')"]
    assert cli.main(run) == 0
    (job,) = broker.jobs()
    assert job.status is JobStatus.SUCCEEDED and job.steps_done == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"job {job.id} reported no step of its 50: no line of its log matched the progress pattern" in err
    assert r"'iter (\\d+)'" in err


def test_ctrl_c_while_run_local_follows_says_the_job_runs_on_and_how_to_stop_it(local, tmp_path, capsys, monkeypatch):
    broker, _ = local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "follow", interrupted)
    assert cli.main(["--broker-url", broker.url, "run-local", "--total-steps", "5", "--work-dir",
                     str(tmp_path / "jobs"), "--", "sleep", "30"]) == 130
    (job,) = broker.jobs()
    out = " ".join(capsys.readouterr().out.split())
    assert (f"job {job.id} goes on without this command (queued, or running on its GPUs); "
            f"`airflow-elastic-gpu --broker-url {broker.url} cancel {job.id[:8]}` stops it") in out  # the same broker
    assert not job.status.terminal


@pytest.mark.parametrize(("flags", "message"), [
    (["--work-dir", "/proc/forbidden"], r"work dir \(the parent of the job directories\) '/proc/forbidden' cannot be created"),
    (["--checkpoint-dir", "/proc/forbidden/ckpt"], "checkpoint_dir '/proc/forbidden/ckpt' cannot be created"),
    (["--checkpoint-dir", "{file}/ckpt"], "checkpoint_dir .* cannot be created: .*Not a directory"),
])
def test_run_local_refuses_an_unusable_directory_before_submitting(local, tmp_path, capsys, flags, message):
    broker, _ = local
    (tmp_path / "file").write_text("")
    flags = [f.replace("{file}", str(tmp_path / "file")) for f in flags]
    assert run_local(broker, tmp_path, *flags) == 2
    assert re.search(message, " ".join(capsys.readouterr().err.split()))
    assert broker.jobs() == []  # no job, so no GPU held


def test_a_start_that_fails_after_submit_fails_the_job_frees_its_gpus_and_leaves_no_process(local, tmp_path,
                                                                                          capsys, monkeypatch):
    broker, _ = local
    spawned: list[int] = []
    real_spawn = LocalBackend._spawn

    def spawn_launcher_then_fail(self, log_path, argv, env):
        if "airflow_elastic_gpu.sidecar.agent" in argv:
            raise BackendError("could not start the agent: out of process slots")
        spawned.append(real_spawn(self, log_path, argv, env))
        return spawned[-1]

    monkeypatch.setattr(LocalBackend, "_spawn", spawn_launcher_then_fail)
    assert run_local(broker, tmp_path) == 2
    assert "out of process slots" in capsys.readouterr().err
    (job,) = broker.jobs()
    assert job.status is JobStatus.FAILED
    assert job.reason == "the local backend could not start the job: could not start the agent: out of process slots"
    assert job.in_use_gpus == () and job.target_gpus == ()
    (launcher,) = spawned
    wait_for(lambda: not protocol.pid_alive(launcher), 10, "the launcher it had started to be killed")


def test_a_reattaching_start_that_fails_leaves_the_running_job_alone(local, monkeypatch):
    broker, backend = local
    job, handle = run_job(broker, backend, "sleep 600")
    os.kill(handle.agent_pid, 9)
    wait_for(lambda: not protocol.pid_alive(handle.agent_pid), 10, "the agent to die")
    monkeypatch.setattr(LocalBackend, "_spawn", lambda *a: (_ for _ in ()).throw(BackendError("no agent")))
    with pytest.raises(BackendError, match="no agent"):
        start_job(broker, backend, broker.job(job.id))  # a retried task: the job was started before
    assert broker.job(job.id).status is JobStatus.RUNNING  # its trainer runs on; a later retry reattaches
    assert protocol.pid_alive(handle.launcher_pid)


@pytest.mark.parametrize(("env", "message"), [
    ({"A": 1}, r"env\['A'\] must be a string without NUL characters, got int 1"),
    ({"A": "x\0y"}, r"env\['A'\] must be a string without NUL"),
    ({"A=B": "1"}, "env: 'A=B' is not a valid environment variable name"),
    ({"": "1"}, "env: '' is not a valid environment variable name"),
    ("A=1", "env must be a dict of environment variable names to string values, got str 'A=1'"),
])
def test_bad_env_is_refused_before_anything_starts(local, env, message):
    broker, backend = local
    job = broker.submit(JobSpec("j", "true", 1, 1, total_steps=1))
    with pytest.raises(BackendError, match=message):
        backend.start(job, env=env)
    assert not backend.job_dir(job.id).exists()


def test_a_new_pool_does_not_take_this_hosts_gpus_a_second_time(local):
    """run-local --pool with a typo (or an operator's pool= naming a pool that does not exist) used
    to register this host's GPUs again in a new pool: the same devices in two pools, handed to a
    job of each. It is refused, naming the pool that has them; that pool still works."""
    broker, backend = local
    before = broker.nodes()
    with pytest.raises(BackendError, match="this host's GPUs are already in pool 'default'.*Use pool 'default'"):
        backend.ensure_pool("defualt")
    assert broker.nodes() == before and broker.pools() == ["default"]
    assert backend.ensure_pool("default") is None
    broker.register_node("gpu-box-7", 2, pool="other")  # a pool of other GPUs: nothing to register
    assert backend.ensure_pool("other") is None


@pytest.mark.parametrize("where", [(LocalBackend, "_start_launchers"), (GpuBroker, "start")])
def test_a_start_interrupted_by_ctrl_c_fails_the_job_rather_than_leave_it_unwatched(local, monkeypatch, where):
    """``run-local`` interrupted while it started the job (or recorded the start): the job stayed running
    with no agent (until its lease ended it) and the launcher it had spawned ran on."""
    broker, backend = local
    job = broker.submit(JobSpec("j", "sleep 600", 1, 1, total_steps=1))
    monkeypatch.setattr(*where, lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        start_job(broker, backend, job)
    view = ended(broker, job.id)
    assert view.status is JobStatus.FAILED and "could not start the job: KeyboardInterrupt" in view.reason
    assert not backend.is_running(job.id)
    assert not view.in_use_gpus and not view.target_gpus


def test_a_local_pool_whose_nodes_share_a_device_index_starts_no_job(local):
    """Every node of a local pool runs on this host: a node added by hand (``nodes add n1 --gpus 2``,
    GPUs 0 and 1) shared node ``localhost``'s devices, and two jobs trained on the same GPUs."""
    broker, backend = local
    broker.register_node("gpu1", 2)  # the default pool, with localhost's 0 and 1
    with pytest.raises(BackendError, match=r"nodes 'gpu1' and 'localhost' with device index 0: the local backend "
                                           r"runs every node of its pool on this host.*nodes remove gpu1 "):
        backend.ensure_pool("default")
    with pytest.raises(BackendError, match="device index 0"):
        submit_and_start(broker, backend, JobSpec("k", "sleep 600", 1, 1, total_steps=1, key="k"), env=None,
                         labels={}, log=logging.getLogger("test"))
    assert broker.jobs() == []  # refused before the broker had it
    broker.remove_node("gpu1")
    assert backend.ensure_pool("default") is None


@pytest.mark.parametrize("argv", [["nodes", "detect", "--pool", "other"],
                                  ["nodes", "add", "--gpus", "2", "--pool", "other"],
                                  # a virtual node's name: the local backend runs it on this host's devices
                                  ["nodes", "add", "localhost-0", "--gpus", "2", "--pool", "other"]])
def test_nodes_detect_and_add_do_not_put_this_host_in_a_second_pool(local, capsys, argv):
    broker, _ = local
    assert cli.main(["--broker-url", broker.url, *argv]) == 2
    assert "this host's GPUs are already in pool 'default'" in " ".join(capsys.readouterr().err.split())
    assert broker.pools() == ["default"]
    assert cli.main(["--broker-url", broker.url, "nodes", "detect"]) == 0  # its own pool again: fine


def test_broker_serve_shows_a_working_database_url_with_its_password_masked(postgres_server_url, capsys,
                                                                            monkeypatch):
    """The line `broker serve` prints before it listens names the database without its password
    (the test server trusts local connections, so any password connects)."""
    import uvicorn
    from sqlalchemy.engine import make_url

    url = make_url(postgres_server_url).set(password="hunter2").render_as_string(hide_password=False)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)  # `broker serve` prints, then serves
    assert cli.main(["--broker-url", url, "broker", "serve"]) == 0
    out = capsys.readouterr()
    assert "hunter2" not in out.out + out.err and "broker API on http://127.0.0.1:8793" in out.out
    assert ":***@" in out.out


RESUMING_TRAINER = """
import json, os, pathlib, sys
ckpt = pathlib.Path(os.environ["ELASTIC_CHECKPOINT_DIR"]) / "step"
start = int(ckpt.read_text()) if ckpt.exists() else 0
print(json.dumps({"resumed_from": start}), flush=True)
for step in range(start + 1, 11):
    ckpt.write_text(str(step))
    print(json.dumps({"step": step}), flush=True)
    if step == 4 and start == 0:
        sys.exit(1)  # the first try dies after its checkpoint of step 4
print(json.dumps({"final": True, "step": 10, "resumed_from": start}), flush=True)
"""


def test_a_retried_task_resumes_from_the_failed_trys_checkpoint_and_a_succeeded_run_keeps_its_own(local, tmp_path):
    """Without checkpoint_dir, the tries of one task (one key) share a checkpoint directory: the
    retry resumes at step 4 where the first try died, not at step 0. Once the job succeeds the
    directory is renamed <dir>@<job id>, so a later run of the task (cleared) starts from 0."""
    broker, backend = local
    trainer = tmp_path / "trainer.py"
    trainer.write_text(RESUMING_TRAINER)
    key = "nightly/train/scheduled__2026-11-26T00:00:00+00:00/-1"

    def run():
        job = broker.submit(JobSpec("train", f"{sys.executable} {trainer}", 1, 1, total_steps=10, key=key))
        start_job(broker, backend, job)
        done = ended(broker, job.id)
        backend.stop(job.id, succeeded=done.status is JobStatus.SUCCEEDED)
        return done

    first = run()
    assert first.status is JobStatus.FAILED
    shared = backend.default_checkpoint_dir(first)
    assert shared.parent == tmp_path / "jobs" / "checkpoints" and (shared / "step").read_text() == "4"
    retry = run()
    assert (retry.status, retry.metrics["resumed_from"]) == (JobStatus.SUCCEEDED, 4)
    assert not shared.exists() and (shared.with_name(f"{shared.name}@{retry.id}") / "step").read_text() == "10"
    cleared = run()  # from step 0 again: it dies at step 4 as the first try did (resumed at 10, it would succeed)
    assert cleared.status is JobStatus.FAILED and (shared / "step").read_text() == "4"


def test_a_try_waits_for_the_earlier_one_still_writing_its_checkpoint(tmp_path):
    """A cleared task's new try must not write the checkpoint directory while the stopped try's
    trainer still writes its last checkpoint: it waits, and refuses past the wait."""
    from airflow_elastic_gpu.backends import local_checkpoints

    path = tmp_path / "checkpoints" / "train-0123"
    local_checkpoints.claim(path, "old", lambda job_id: False, 1.0)
    stops_at = time.monotonic() + 0.5
    assert local_checkpoints.claim(path, "new", lambda job_id: time.monotonic() < stops_at, 5.0) == path
    assert time.monotonic() >= stops_at and path.with_name("train-0123.owner").read_text() == "new"
    with pytest.raises(BackendError, match="is still used by job new"):
        local_checkpoints.claim(path, "newer", lambda job_id: True, 0.3)
    path.mkdir()
    local_checkpoints.keep_after_success(path, "other")  # not its user: left alone
    assert path.is_dir()
    local_checkpoints.keep_after_success(path, "new")
    local_checkpoints.keep_after_success(path, "new")  # a second stop: nothing left to rename
    assert not path.exists() and path.with_name("train-0123@new").is_dir()


@pytest.mark.parametrize("recorded", ["another job's mark", "another boot", "another start"])
def test_pids_recorded_before_a_reboot_that_now_belong_to_other_processes_are_never_killed(local, tmp_path, recorded):
    """After a host restart (or once a pid is reused) the pids in a job's handle and status files
    may be any process's: the job counts as not running, and starting it again (a retry) kills
    none of them. A process with another job's mark is not the job's; one with no mark at all
    counts as possibly the job's (one started before the mark existed), and the boot and start
    time recorded with the pids tell the job's own from it."""
    from airflow_elastic_gpu.backends.local_processes import boot_id, start_ticks

    broker, backend = local
    job = broker.submit(JobSpec("j", f"{sys.executable} -c 'print(1)'", 1, 1, total_steps=1))
    job_dir = backend.job_dir(job.id)
    job_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_GPU_JOB_ID"}
    if recorded == "another job's mark":
        env["ELASTIC_GPU_JOB_ID"] = "another-job"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                                env=env)
    try:
        # the handle and status as the job left them before the restart; the pids are now the stranger's
        handle = {"job_dir": str(job_dir), "agent_pid": stranger.pid, "launcher_pid": stranger.pid}
        if recorded != "another job's mark":
            protocol.write_json(job_dir / "handle.json", handle)
            assert backend.is_running(job.id)  # no mark, nothing recorded: nothing tells it from the job's own
        if recorded == "another boot":
            handle["boot_id"] = "00000000-0000-0000-0000-000000000000"
        elif recorded == "another start":
            handle.update(boot_id=boot_id(), starts={str(stranger.pid): start_ticks(stranger.pid) - 1})
        protocol.write_json(job_dir / "handle.json", handle)
        protocol.write_json(job_dir / protocol.STATUS, {"state": "running", "generation": 1, "pid": stranger.pid,
                                                        "workers": [stranger.pid]})
        assert not backend.is_running(job.id)
        backend.start(job)
        again = backend.handle(job.id)
        assert again.agent_pid != stranger.pid and backend.is_running(job.id)
        assert again.boot == boot_id() and dict(again.starts)[again.agent_pid] == start_ticks(again.agent_pid)
        assert stranger.poll() is None  # alive: not the job's, whatever the files say
    finally:
        stranger.kill()
        stranger.wait()
        backend.stop(job.id, timeout_s=5)
