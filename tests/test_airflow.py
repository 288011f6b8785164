"""The Airflow provider: metadata, operator arguments, trigger, on_kill, and a real DAG run (`airflow dags test`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow.exceptions import AirflowException
from conftest import REPO
from test_sidecar import TRAINER, wait_for

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "tests" / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_ELASTIC_GPU_BROKER_URL": f"sqlite:///{home / 'broker.db'}",
        "AIRFLOW_ELASTIC_GPU_WORK_DIR": str(home / "jobs"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return env


def test_provider_is_listed_by_airflow(airflow_env):
    out = subprocess.run([AIRFLOW, "providers", "list", "-o", "json"], env=airflow_env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    names = {p["package_name"] for p in json.loads(out[out.index("["):])}
    assert "airflow-elastic-gpu" in names


def test_airflow_config_list_shows_the_providers_section_with_every_option(airflow_env):
    from airflow_elastic_gpu.config import OPTIONS

    out = subprocess.run([AIRFLOW, "config", "list", "--section", "elastic_gpu", "--include-descriptions",
                          "--show-values"], env=airflow_env, check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert "[elastic_gpu]" in out
    for option in OPTIONS:
        assert re.search(rf"^#? ?{option.name} = ", out, re.MULTILINE), option.name
    assert "poll_interval = 5.0" in out and "default_pool = default" in out


def test_airflows_conf_serves_the_sections_defaults_and_its_environment_overrides(airflow_env):
    def get(key: str, **extra: str) -> str:
        return subprocess.run([AIRFLOW, "config", "get-value", "elastic_gpu", key], env={**airflow_env, **extra},
                              check=True, capture_output=True, text=True, timeout=120).stdout.strip()

    assert get("default_pool") == "default"
    assert get("default_pool", AIRFLOW__ELASTIC_GPU__DEFAULT_POOL="a100") == "a100"


HOOK_META = """
import json
from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
(meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == "elastic_gpu"]
print("HOOK_META" + meta.model_dump_json())
"""


def test_airflows_connection_form_shows_the_brokers_fields_and_hides_the_standard_ones(airflow_env):
    # the code path of the API server's GET /ui/connections/hook_meta, which the connection form reads
    out = subprocess.run([sys.executable, "-c", HOOK_META], env=airflow_env, check=True, capture_output=True,
                         text=True, timeout=120).stdout
    meta = json.loads(out[out.index("HOOK_META") + len("HOOK_META"):])
    assert meta["hook_name"] == "Elastic GPU broker"
    assert meta["hook_class_name"] == "airflow_elastic_gpu.hooks.broker.GpuBrokerHook"
    fields = meta["extra_fields"]
    assert {name: f["schema"]["title"] for name, f in fields.items()} == {
        "url": "Broker database URL", "pool": "Default GPU pool", "api_url": "Broker API URL"}
    assert fields["url"]["schema"]["format"] == "password"
    for name in ("host", "port", "login", "password", "url_schema"):
        assert meta["standard_fields"][name]["hidden"] is True, name


def test_the_hook_reads_the_forms_fields_and_falls_back_to_the_config_section(monkeypatch, tmp_path):
    from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps({"conn_type": "elastic_gpu", "extra": {
        "url": f"sqlite:///{tmp_path / 'conn.db'}", "pool": "a100", "api_url": "http://broker:8793"}}))
    monkeypatch.delenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", raising=False)
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__BROKER_URL", f"sqlite:///{tmp_path / 'cfg.db'}")
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__DEFAULT_POOL", "cfg-pool")
    hook = GpuBrokerHook()
    assert (hook.get_url(), hook.default_pool(), hook.broker_api_url()) == (
        f"sqlite:///{tmp_path / 'conn.db'}", "a100", "http://broker:8793")
    missing = GpuBrokerHook("elastic_gpu_missing")
    assert (missing.get_url(), missing.default_pool(), missing.broker_api_url()) == (
        f"sqlite:///{tmp_path / 'cfg.db'}", "cfg-pool", None)


def test_deferrable_and_poll_interval_default_to_the_config_section(monkeypatch):
    args = {"task_id": "t", "command": "python train.py", "total_steps": 10}
    op = ElasticTrainingOperator(**args)
    assert op.deferrable is True and op.poll_interval == 5.0
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__DEFAULT_DEFERRABLE", "False")
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__POLL_INTERVAL", "0.5")
    op = ElasticTrainingOperator(**args)
    assert op.deferrable is False and op.poll_interval == 0.5
    assert ElasticTrainingOperator(**args, deferrable=True, poll_interval=2).deferrable is True


def test_a_training_without_a_pool_goes_to_the_connections_default_pool(worker_env, monkeypatch):
    broker, _, trainer = worker_env
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"url": str(broker.engine.url), "pool": "team-a"}}))
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 virtual_gpus=2, poll_interval=0.2, deferrable=False)
    ti = _FakeTI()
    op.execute({"ti": ti})
    assert broker.job(ti.xcom["job_id"]).pool == "team-a" and ti.xcom["gpu_pool"] == "team-a"


def test_dag_with_a_training_and_a_mapped_training_over_three_configs_succeeds(airflow_env):
    run = subprocess.run([AIRFLOW, "dags", "test", "elastic_test"], env=airflow_env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "state=success" in run.stdout + run.stderr
    broker = GpuBroker(airflow_env["AIRFLOW_ELASTIC_GPU_BROKER_URL"])
    jobs = broker.jobs()
    assert sorted(j.name for j in jobs) == ["mapped[0]", "mapped[1]", "mapped[2]", "single"]
    # one family per task, whatever the map index: the prior of each other's first steps
    assert sorted({j.family for j in jobs}) == ["elastic_test.mapped", "elastic_test.single"]
    for j in jobs:
        assert j.status is JobStatus.SUCCEEDED and j.metrics["accuracy"] >= 0.9, j
        assert j.in_use_gpus == () and j.key.startswith("elastic_test/")
    logs = run.stdout + run.stderr
    assert "[start] generation 1" in logs, "the job's allocations are logged into the task log"


def test_a_finished_training_emits_its_model_asset_event_with_its_figures_and_the_downstream_dag_runs(
        airflow_env):
    env = airflow_env

    def airflow(*args: str, timeout: float = 300) -> str:
        run = subprocess.run([AIRFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout,
                             check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return run.stdout + run.stderr

    airflow("dags", "reserialize")  # the downstream DAG's asset schedule is known to the metadata DB
    airflow("dags", "unpause", "elastic_asset_evaluate")  # a paused DAG is not queued for its assets
    assert "state=success" in airflow("dags", "test", "elastic_asset_train", timeout=600)
    db = sqlite3.connect(Path(airflow_env["AIRFLOW_HOME"]) / "airflow.db")
    try:
        ((uri, extra),) = db.execute(
            "SELECT a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id").fetchall()
        figures = json.loads(extra)
        assert uri == "file:///elastic-test/models/mlp-32"
        assert figures["final_step"] == 60 and figures["exit_code"] == 0 and figures["accuracy"] > 0.5
        assert figures["gpu_hours"] == pytest.approx(figures["gpu_seconds"] / 3600) and figures["gpu_hours"] > 0
        assert figures["num_resizes"] >= 0 and figures["jct_s"] > 0 and figures["name"] == "train"
        assert db.execute("SELECT target_dag_id FROM asset_dag_run_queue").fetchall() == [
            ("elastic_asset_evaluate",)]
        runs = scheduler_loop_until_the_asset_run(env, db, Path(airflow_env["AIRFLOW_HOME"]) / "scheduler.log")
        assert runs == [("asset_triggered",)]
        assert db.execute("SELECT count(*) FROM dagrun_asset_event").fetchone() == (1,)
    finally:
        db.close()


def scheduler_loop_until_the_asset_run(env: dict[str, str], db: sqlite3.Connection, log: Path,
                                      timeout_s: float = 300) -> list[tuple]:
    """Run ``airflow scheduler --num-runs 1`` (one loop turns the asset queue into a DAG run) and
    return the downstream DAG's runs once it has one. The scheduler is stopped if it is still up by
    then: Airflow 3.3's scheduler sometimes hangs in its shutdown after the loop, which is not what
    this test is about."""
    query = "SELECT run_type FROM dag_run WHERE dag_id = 'elastic_asset_evaluate'"
    with open(log, "wb") as out:
        proc = subprocess.Popen([AIRFLOW, "scheduler", "--num-runs", "1"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    runs: list[tuple] = []
    try:
        while time.monotonic() < deadline:
            try:
                runs = db.execute(query).fetchall()
            except sqlite3.OperationalError:  # the scheduler is writing: read again
                runs = []
            if runs or proc.poll() is not None:
                break
            time.sleep(0.5)
        if not runs:
            runs = db.execute(query).fetchall()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert runs, f"no run of the downstream DAG; scheduler exit {proc.returncode}:\n{log.read_text()[-3000:]}"
    return runs


def test_trigger_serialization_round_trips():
    trigger = ElasticTrainingTrigger("job-1", "conn", 2.5, "local", "/tmp/jobs", after_event_id=7)
    path, kwargs = trigger.serialize()
    assert path == "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger"
    again = ElasticTrainingTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"min_gpus": 3, "max_gpus": 2}, r"min_gpus \(3\) must not be larger than max_gpus \(2\)"),
    ({"min_gpus": 0}, "min_gpus must be an integer >= 1"),
    ({"total_steps": -5}, "total_steps must be an integer >= 1"),
    ({"backend": "slurm"}, "backend must be one of"),
    ({"progress_pattern": "step=("}, "not a valid regex"),
    ({"poll_interval": 0}, "poll_interval must be a number of seconds > 0"),
    ({"poll_interval": float("nan")}, "poll_interval must be a number of seconds > 0"),
    ({"priority": "high"}, "priority must be an integer"),
    ({"gpu_pool": ""}, "gpu_pool must not be empty"),
    ({"gpu_pool": "team/a"}, "gpu_pool must not contain '/'"),
    ({"command": ""}, "command must not be empty"),
    ({"requested_gpus": 99, "max_gpus": 2}, "requested_gpus"),
    ({"virtual_gpus": 0}, "virtual_gpus must be an integer >= 1"),
    ({"virtual_gpus": "4"}, "virtual_gpus must be an integer >= 1"),
    ({"virtual_nodes": 0}, "virtual_nodes must be an integer >= 1"),
    ({"relative_speed": {"NVIDIA A100": -2.0}}, r"relative_speed\['NVIDIA A100'\] must be a finite number > 0"),
    ({"preemptible": "yes"}, "preemptible must be True or False"),
    ({"env": "A=1"}, "env must be a dict of environment variable names to string values"),
    ({"env": {"A": 1}}, r"env\['A'\] must be a string"),
    ({"backend": "kubernetes", "image": "i", "kubernetes": {"namespace": "Bad_NS!"}},
     "namespace must be a DNS-1123 label"),
    ({"backend": "kubernetes", "image": "i", "kubernetes": {"startup_grace_s": -1}},
     "startup_grace_s must be a number of seconds >= 0"),
    ({"backend": "kubernetes", "image": "i", "kubernetes": {"volumes": "abc"}}, "volumes must be a list of dicts"),
    ({"backend": "kubernetes", "image": "i", "kubernetes": {"labels": {"elastic-gpu.airflow.apache.org/job-id": "x"}}},
     "is set by airflow-elastic-gpu"),
])
def test_bad_operator_arguments_fail_at_dag_parse_time(kwargs, match):
    args = {"task_id": "t", "command": "python train.py", "total_steps": 10, **kwargs}
    with pytest.raises(AirflowException, match=match):
        ElasticTrainingOperator(**args)


def test_trigger_fires_on_the_brokers_terminal_state_and_on_kill_releases_gpus(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("localhost", 2)
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time, json\nfor i in range(10000):\n    print(json.dumps({'step': i}), flush=True)\n"
                       "    time.sleep(0.1)\n")
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2, grace_s=5)
    job = broker.submit(JobSpec("sleeper", f"{sys.executable} {sleeper}", 1, 2, total_steps=10000))
    broker.start(job.id, backend.start(job))
    deadline = time.monotonic() + 60
    while broker.job(job.id).steps_done < 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    trigger = ElasticTrainingTrigger(job.id, "elastic_gpu_missing_conn", 0.2, "local", str(tmp_path / "jobs"))

    async def kill_then_wait():
        await trigger.on_kill()
        return await asyncio.wait_for(trigger.run().__anext__(), 30)

    event = asyncio.run(kill_then_wait())
    assert event.payload["status"] == "cancelled"
    done = broker.job(job.id)
    assert done.in_use_gpus == () and done.target_gpus == ()
    assert not backend.is_running(job.id)


def test_on_kill_of_a_trigger_moved_to_another_triggerer_leaves_the_job_running(tmp_path, monkeypatch):
    """Airflow 3.3 calls on_kill on the old triggerer when a trigger is reassigned (its heartbeat was
    late); the task instance is still deferred then, and the job must go on."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    url = f"sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("moved", "true", 1, 2, total_steps=10))
    asked = []

    def deferred_count(**kwargs):
        asked.append(kwargs)
        return 1

    monkeypatch.setattr(RuntimeTaskInstance, "get_ti_count", staticmethod(deferred_count))
    trigger = ElasticTrainingTrigger(job.id, "elastic_gpu_missing_conn", 0.2, "local", str(tmp_path / "jobs"))
    trigger.task_instance = _trigger_ti()
    asyncio.run(trigger.on_kill())
    assert broker.job(job.id).status is not JobStatus.CANCELLED
    assert asked == [{"dag_id": "sft", "task_ids": ["train"], "run_ids": ["manual__1"], "map_index": -1,
                      "states": ["deferred"]}]


class _FakeTI:
    """The task-instance fields the operator reads, for a retry test without a metadata DB."""

    dag_id, task_id, run_id, map_index = "retry_dag", "train", "manual__1", -1

    def __init__(self) -> None:
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def test_a_retried_task_reattaches_to_its_running_job_then_a_later_retry_replaces_it(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    url = f"sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_WORK_DIR", str(tmp_path / "jobs"))
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time, json\nfor i in range(10000):\n    print(json.dumps({'step': i}), flush=True)\n"
                       "    time.sleep(0.1)\n")
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {sleeper}", total_steps=10000,
                                 min_gpus=1, max_gpus=2, virtual_gpus=3, poll_interval=0.2)
    context = {"ti": _FakeTI()}
    job_ids = []
    for _attempt in range(2):  # the worker died after deferring; the retry runs execute again
        with pytest.raises(TaskDeferred):
            op.execute(context)
        job_ids.append(context["ti"].xcom["job_id"])
    broker = GpuBroker(url)
    backend = LocalBackend(tmp_path / "jobs", broker)
    try:
        assert job_ids[0] == job_ids[1]  # reattached, not a second job
        assert len(broker.jobs()) == 1
        deadline = time.monotonic() + 60
        while not broker.job(job_ids[0]).in_use_gpus:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        held = [g for g in _gpus(broker) if g.in_use_by]
        assert {g.in_use_by for g in held} == {job_ids[0]}
        assert len(held) == len({g.gpu for g in held}) <= 2
        # the job ends (here: cancelled); a later retry of the same try key starts a fresh job
        broker.cancel(job_ids[0], "test")
        backend.stop(job_ids[0], timeout_s=30)
        with pytest.raises(TaskDeferred):
            op.execute(context)
        new_id = context["ti"].xcom["job_id"]
        assert new_id != job_ids[0]
        assert broker.job(job_ids[0]).key.endswith(f"@{job_ids[0]}")  # the old record is kept
        assert broker.job(new_id).status in (JobStatus.QUEUED, JobStatus.RUNNING)
        assert {g.in_use_by for g in _gpus(broker) if g.in_use_by} <= {new_id}
    finally:
        for job in broker.jobs():
            if not job.status.terminal:
                broker.cancel(job.id, "test cleanup")
            backend.stop(job.id, timeout_s=30)


@pytest.fixture
def worker_env(tmp_path, monkeypatch) -> Iterator[tuple[GpuBroker, LocalBackend, Path]]:
    """A broker and job directory for operators run in this process (as a worker runs them), and a
    stand-in trainer that prints JSON progress lines (``trainer.py x STEPS``, 20 steps/s)."""
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


def test_a_non_deferrable_task_runs_its_job_to_success_in_the_worker(worker_env):
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 30", total_steps=30,
                                 min_gpus=1, max_gpus=2, virtual_gpus=2, poll_interval=0.2, deferrable=False)
    ti = _FakeTI()
    result = op.execute({"ti": ti})  # returns only once the job has ended: no TaskDeferred
    job = broker.job(ti.xcom["job_id"])
    assert job.status is JobStatus.SUCCEEDED and job.in_use_gpus == ()
    assert result["job_id"] == job.id and result["final_step"] == 30 and result["accuracy"] == 0.95
    assert result["exit_code"] == 0 and result["jct_s"] > 0
    wait_for(lambda: not backend.is_running(job.id), 10, "the job's processes to be gone")


def test_a_non_deferrable_task_fails_with_the_reason_when_the_jobs_processes_are_killed(worker_env):
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100_000, virtual_gpus=2, poll_interval=0.2, deferrable=False)
    ti = _FakeTI()
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            op.execute({"ti": ti})
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    job_id = wait_for(lambda: ti.xcom.get("job_id"), 30, "the job to be submitted")
    wait_for(lambda: broker.job(job_id).steps_done >= 3, 60, "the job to make progress")
    handle = backend.handle(job_id)
    trainer_pid = protocol.read_json(handle.job_dir / protocol.STATUS)["pid"]
    for pid in (handle.agent_pid, handle.launcher_pid, trainer_pid):  # what a host's OOM killer might do
        os.kill(pid, signal.SIGKILL)
    worker.join(30)
    assert not worker.is_alive(), "the task never noticed that its job's processes were gone"
    error = outcome["error"]
    assert isinstance(error, AirflowException)
    assert f"train: training job {job_id} failed" in str(error) and "processes are gone" in str(error)
    job = broker.job(job_id)
    assert job.status is JobStatus.FAILED and "processes are gone" in job.reason
    assert job.in_use_gpus == () and job.target_gpus == ()


def _gpus(broker: GpuBroker):
    return [g for node in broker.snapshot().nodes for g in node.gpus]


def test_plugin_serves_the_api_and_the_page_inside_airflow(airflow_env):
    run = subprocess.run([AIRFLOW, "plugins", "-o", "json"], env=airflow_env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    plugins = json.loads(run.stdout[run.stdout.index("[{"):])
    ours = next(p for p in plugins if p["name"] == "elastic_gpu")
    assert "/elastic-gpu" in json.dumps(ours["fastapi_apps"])
    assert "GPU pool" in json.dumps(ours["external_views"])
    assert "ElasticJobLink" in json.dumps(ours)


def test_extra_link_points_at_the_job_on_the_pool_page(monkeypatch):
    from airflow_elastic_gpu.links import job as link_module

    xcom = {"job_id": "job-123", "gpu_pool": "a100"}
    monkeypatch.setattr(link_module.XCom, "get_value", staticmethod(lambda ti_key, key: xcom.get(key)))
    op = ElasticTrainingOperator(task_id="t", command="python train.py", total_steps=10)
    assert link_module.ElasticJobLink().get_link(op, ti_key=None) == "/elastic-gpu/ui?pool=a100&job=job-123"
    assert any(isinstance(l, link_module.ElasticJobLink) for l in op.operator_extra_links)


def test_an_env_rendered_to_a_non_string_is_refused_before_the_job_is_submitted(worker_env):
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 virtual_gpus=2, env={"EPOCHS": "{{ params.epochs }}"})
    op.env = {"EPOCHS": 3}  # what render_template_as_native_obj=True makes of the template
    with pytest.raises(AirflowException, match=r"train: env\['EPOCHS'\] must be a string"):
        op.execute({"ti": _FakeTI()})
    assert broker.jobs() == []


def test_a_job_the_backend_cannot_start_is_failed_with_the_reason_and_frees_its_gpus(worker_env, monkeypatch):
    broker, _, trainer = worker_env

    def broken_start(self, job, *, env=None, context=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalBackend, "start", broken_start)
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 virtual_gpus=2)
    with pytest.raises(OSError, match="No space left on device"):  # not a BackendError: raised as it is
        op.execute({"ti": _FakeTI()})
    (job,) = broker.jobs()
    assert job.status is JobStatus.FAILED and job.reason.endswith("No space left on device")
    assert job.in_use_gpus == () and job.target_gpus == ()


def test_the_example_dags_parse_and_promotion_is_scheduled_on_the_retrainings_model_asset(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    bag = DagBag(str(REPO / "dags"))
    assert bag.import_errors == {}
    retrain = bag.dags["nightly_retraining"].get_task("retrain")
    promote = bag.dags["promote_best_model"]
    (model,) = retrain.partial_kwargs["outlets"]
    assert model.name == "nightly_retraining_models"
    assert list(promote.timetable.asset_condition.objects) == [model]


def _trigger_ti(run_id: str = "manual__1"):
    from types import SimpleNamespace

    return SimpleNamespace(dag_id="sft", task_id="train", run_id=run_id, map_index=-1, try_number=1)


def test_started_from_the_triggerer_the_trigger_submits_the_job_and_a_restarted_one_reattaches(worker_env):
    broker, _backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 30", total_steps=30,
                                 virtual_gpus=2, poll_interval=0.2, start_from_trigger=True)
    assert op.start_trigger_args.trigger_cls == "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger"
    assert op.start_trigger_args.next_method == "execute_complete"
    kwargs = op.start_trigger_args.trigger_kwargs
    assert kwargs["job_id"] is None and kwargs["command"] == op.command
    first = ElasticTrainingTrigger(**kwargs)
    first.task_instance = _trigger_ti()
    job_id = asyncio.run(asyncio.to_thread(first._submit)).id
    # the triggerer restarts: the trigger is made again from its stored arguments and submits again
    again = ElasticTrainingTrigger(**ElasticTrainingTrigger(**kwargs).serialize()[1])
    again.task_instance = _trigger_ti()
    event = asyncio.run(asyncio.wait_for(again.run().__anext__(), 60))
    assert event.payload["job_id"] == job_id and event.payload["status"] == "succeeded"
    (job,) = broker.jobs()
    assert job.key == "sft/train/manual__1/-1" and job.in_use_gpus == ()
    ti = _FakeTI()
    result = op.execute_complete({"ti": ti}, event.payload)
    assert result["final_step"] == 30 and ti.xcom == {"job_id": job_id, "gpu_pool": "default"}


def test_a_job_the_triggerer_cannot_submit_fails_the_task_with_the_reason(worker_env):
    op = ElasticTrainingOperator(task_id="train", command="no-such-program-xyz --epochs 1", total_steps=3,
                                 virtual_gpus=2, start_from_trigger=True)
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = _trigger_ti()
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 60))
    assert event.payload["job_id"] is None and event.payload["status"] == "error"
    with pytest.raises(AirflowException, match="the triggerer could not start the training: .*no-such-program"):
        op.execute_complete({"ti": _FakeTI()}, event.payload)


def test_start_from_trigger_needs_a_deferrable_operator():
    with pytest.raises(AirflowException, match="start_from_trigger=True needs deferrable=True"):
        ElasticTrainingOperator(task_id="t", command="python train.py", total_steps=10, deferrable=False,
                                start_from_trigger=True)
