"""The operator and the trigger as a worker and a triggerer run them, in this process: operator
arguments checked at parse time, the trigger's serialisation, its end on the broker's terminal
state, ``on_kill``, retries that re-attach, non-deferrable runs and starts from the triggerer
(a real Airflow, ``airflow dags test`` and the scheduler: ``test_airflow.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import pytest
from airflow.exceptions import AirflowException, AirflowFailException
from test_sidecar import wait_for

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger


def test_a_training_without_a_pool_goes_to_the_connections_default_pool(worker_env, monkeypatch):
    broker, _, trainer = worker_env
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"url": str(broker.engine.url), "pool": "team-a"}}))
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 virtual_gpus=2, poll_interval=0.2, deferrable=False)
    ti = _FakeTI()
    op.execute({"ti": ti})
    assert broker.job(ti.xcom["job_id"]).pool == "team-a" and ti.xcom["gpu_pool"] == "team-a"


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
    ({"job_name": " "}, "job_name must not be empty"),
    ({"command": ""}, "command must not be empty"),
    ({"command": "python -c 'print(1)"}, "does not parse .* No closing quotation"),
    ({"checkpoint_dir": "ckpt/run1"}, "checkpoint_dir 'ckpt/run1' must be an absolute path"),
    ({"checkpoint_dir": "~/ckpt"}, "must be an absolute path"),
    ({"deferrable": "false"}, "deferrable must be True or False, got 'false'"),
    ({"start_from_trigger": "no"}, "start_from_trigger must be True or False, got 'no'"),
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
    """... and without a retry where they are found in a try: a mapped task unmaps (makes its
    operator) in each try, so a bad mapped value used up every retry, each after its delay."""
    args = {"task_id": "t", "command": "python train.py", "total_steps": 10, **kwargs}
    with pytest.raises(AirflowFailException, match=match):
        ElasticTrainingOperator(**args)


def test_template_fields_may_take_an_upstream_tasks_output_and_are_checked_when_the_task_runs():
    """``command=build.output`` (an XComArg) is known only when the task runs: the DAG parses, and
    the fields the operator checks at parse time are checked then instead."""
    from airflow.sdk import DAG, task

    with DAG("xcom_args", schedule=None):
        @task
        def build() -> str:
            return "python train.py"

        made = build()
        op = ElasticTrainingOperator(task_id="train", command=made, total_steps=10, job_name=made,
                                     checkpoint_dir=made, env={"RUN": made, "OMP_NUM_THREADS": "1"})
    assert op.command is made and op.env == {"OMP_NUM_THREADS": "1", "RUN": made}
    with pytest.raises(AirflowException, match=r"env\['N'\] must be a string"):
        ElasticTrainingOperator(task_id="bad", command="python train.py", total_steps=10, env={"N": 1})
    with pytest.raises(AirflowException, match=r"start_from_trigger=True cannot take an upstream task's output "
                                               r"\(command, env\)"):
        ElasticTrainingOperator(task_id="early", command=made, total_steps=10, env={"RUN": made},
                                start_from_trigger=True)


def test_the_brokers_figures_are_not_replaced_by_trainer_metrics_of_the_same_name(tmp_path):
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("n0", 1)
    job = broker.submit(JobSpec("t", "python train.py", total_steps=10))
    broker.ack(job.id, 1)
    broker.finish(job.id, 0, {"final": True, "step": 10, "job_id": "mine", "exit_code": 3, "accuracy": 0.9})
    result = ElasticTrainingOperator.metrics(broker.job(job.id))
    assert (result["job_id"], result["exit_code"], result["accuracy"]) == (job.id, 0, 0.9)


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
    # the "GPU job" button works while the task waits (Airflow pushes a link itself only at a run's end)
    assert ti.xcom["_link_ElasticJobLink"] == f"elastic-gpu/ui?pool=default&job={job_id}"
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


def test_a_template_rendered_to_a_bad_value_fails_the_task_before_the_job_is_submitted(worker_env):
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 virtual_gpus=2, env={"EPOCHS": "{{ params.epochs }}"})
    op.env = {"EPOCHS": 3}  # what render_template_as_native_obj=True makes of the template
    # a retry renders the same value: failed at once, not retried
    with pytest.raises(AirflowFailException, match=r"train: env\['EPOCHS'\] must be a string"):
        op.execute({"ti": _FakeTI()})
    op.env, op.command, op.max_gpus = {}, "   ", 2  # a template rendered to nothing; a mapped max_gpus < min
    with pytest.raises(AirflowFailException, match=r"train: command must not be empty"):
        op.execute({"ti": _FakeTI()})
    op.command, op.min_gpus = f"{sys.executable} {trainer} x 3", 3
    with pytest.raises(AirflowFailException, match=r"train: .*max_gpus"):
        op.execute({"ti": _FakeTI()})
    # the connection's pool is no template: mended there, the next try takes it (retried)
    op.min_gpus, op.hook.default_pool = 1, lambda: "bad/pool"
    with pytest.raises(AirflowException, match=r"the connection's pool must not contain '/'") as raised:
        op.execute({"ti": _FakeTI()})
    assert not isinstance(raised.value, AirflowFailException)
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


def _trigger_ti(run_id: str = "manual__1", ti_id: str = "0193a1b2-try-1"):
    """The trigger's task instance as the triggerer gives it: ``id`` is new for every try."""
    from types import SimpleNamespace

    return SimpleNamespace(id=ti_id, dag_id="sft", task_id="train", run_id=run_id, map_index=-1, try_number=1)


def _started_from_trigger(op: ElasticTrainingOperator) -> tuple[dict, str]:
    """``op``'s trigger arguments, and the job its first trigger submitted and started."""
    kwargs = op.start_trigger_args.trigger_kwargs
    first = ElasticTrainingTrigger(**kwargs)
    first.task_instance = _trigger_ti()
    return kwargs, asyncio.run(asyncio.to_thread(first._submit)).id


def _made_again(kwargs: dict) -> ElasticTrainingTrigger:
    """The trigger made again from its stored arguments (a restarted triggerer), for the same try."""
    again = ElasticTrainingTrigger(**ElasticTrainingTrigger(**kwargs).serialize()[1])
    again.task_instance = _trigger_ti()
    return again


def test_started_from_the_triggerer_the_trigger_submits_the_job_and_a_restarted_one_reattaches(worker_env):
    broker, _backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 30", total_steps=30,
                                 virtual_gpus=2, poll_interval=0.2, start_from_trigger=True)
    assert op.start_trigger_args.trigger_cls == "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger"
    assert op.start_trigger_args.next_method == "execute_complete"
    kwargs = op.start_trigger_args.trigger_kwargs
    assert kwargs["job_id"] is None and kwargs["command"] == op.command
    kwargs, job_id = _started_from_trigger(op)
    # the triggerer restarts: the trigger is made again from its stored arguments and submits again
    event = asyncio.run(asyncio.wait_for(_made_again(kwargs).run().__anext__(), 60))
    assert event.payload["job_id"] == job_id and event.payload["status"] == "succeeded"
    (job,) = broker.jobs()
    assert job.key == "sft/train/manual__1/-1" and job.in_use_gpus == ()
    ti = _FakeTI()
    result = op.execute_complete({"ti": ti}, event.payload)
    assert result["final_step"] == 30 and ti.xcom == {"job_id": job_id, "gpu_pool": "default",
                                                 "_link_ElasticJobLink": f"elastic-gpu/ui?pool=default&job={job_id}"}


def test_a_trigger_made_again_after_its_job_ended_fires_that_end_and_a_retry_trains_anew(worker_env):
    """The triggerer was away while the job it submitted ended: the trigger made again from its
    stored arguments submits the key again and gets that ended job back (it does not train it a
    second time); only a new try of the task (a new task instance id) starts a new job."""
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 30", total_steps=30,
                                 virtual_gpus=2, poll_interval=0.2, start_from_trigger=True)
    kwargs, job_id = _started_from_trigger(op)
    wait_for(lambda: broker.job(job_id).status.terminal, timeout_s=60)  # no trigger watched it end
    event = asyncio.run(asyncio.wait_for(_made_again(kwargs).run().__anext__(), 60))
    assert event.payload["job_id"] == job_id and event.payload["status"] == "succeeded"
    assert [j.id for j in broker.jobs()] == [job_id], "the ended job was not submitted again"
    retry = ElasticTrainingTrigger(**kwargs)
    retry.task_instance = _trigger_ti(ti_id="0193a1b2-try-2")
    new_id = asyncio.run(asyncio.to_thread(retry._submit)).id
    assert new_id != job_id and broker.job(job_id).key == f"sft/train/manual__1/-1@{job_id}"
    backend.stop(new_id, timeout_s=10)


def test_a_trigger_whose_broker_has_no_such_job_fails_the_task_rather_than_wait_forever(worker_env, monkeypatch):
    """A triggerer configured with another broker than the worker's (a missing connection on one
    of them) finds no such job: once reading the connection again has not changed that for
    NOT_FOUND_GRACE_S, the task fails with the reason."""
    from airflow_elastic_gpu.triggers import training

    monkeypatch.setattr(training, "NOT_FOUND_GRACE_S", 0.5)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=3, poll_interval=0.1)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id="no-such-job", labels=None))
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
    assert event.payload["status"] == "error" and "unknown job 'no-such-job'" in event.payload["reason"]
    assert "the triggerer must reach the broker the task submitted to" in event.payload["reason"]
    with pytest.raises(AirflowException, match="could not follow training job no-such-job: unknown job"):
        op.execute_complete({"ti": _FakeTI()}, event.payload)


def test_execution_timeout_holds_while_the_task_is_deferred(worker_env):
    """Airflow does not time out a deferred task: the trigger cancels the job once the try has run
    ``execution_timeout`` (a deadline in its arguments), stops its processes, and the task fails."""
    from datetime import timedelta

    from airflow.sdk.exceptions import TaskDeferred

    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=1, poll_interval=0.2,
                                 execution_timeout=timedelta(seconds=2))
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": _FakeTI()})
    trigger = deferred.value.trigger
    assert before + 2.0 <= trigger.serialize()[1]["deadline_s"] <= time.time() + 2.0  # 2 s from execute's start
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 60))
    job = broker.job(event.payload["job_id"])
    assert event.payload["status"] == "cancelled" and "execution_timeout" in event.payload["reason"]
    assert job.in_use_gpus == () and not backend.is_running(job.id)
    with pytest.raises(AirflowException, match="cancelled: execution_timeout: the task's time ran out"):
        op.execute_complete({"ti": _FakeTI()}, event.payload)


def test_a_trigger_killed_while_it_submits_stops_the_job_it_started(worker_env, monkeypatch):
    """A user marks the task failed while its trigger is still submitting: the triggerer cancels
    ``run`` and calls ``on_kill``, which waits for the submission and stops the job it started
    (rather than leave it training with no task to stop it)."""
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=1, poll_interval=0.2, start_from_trigger=True)
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = _trigger_ti()
    submit = trigger._submit

    def slow_submit():
        time.sleep(1.0)
        return submit()

    monkeypatch.setattr(trigger, "_submit", slow_submit)

    async def kill_while_submitting():
        running = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(0.3)
        running.cancel()  # as the triggerer does, then on_kill
        await trigger.on_kill()

    asyncio.run(kill_while_submitting())
    (job,) = broker.jobs()
    assert job.status is JobStatus.CANCELLED and not backend.is_running(job.id)


@pytest.mark.parametrize("still_deferred", [True, None, False])
def test_a_cancelled_trigger_stops_its_job_only_once_the_task_is_no_longer_deferred(worker_env, still_deferred):
    """Airflow cancels ``run`` without ``on_kill`` when a ``start_from_trigger`` task's
    execution_timeout (its trigger timeout) passes: the task is then no longer deferred, and the
    job is stopped. A triggerer shutting down or handing the trigger over leaves the task deferred,
    or cannot tell (no supervisor to ask, None): the job goes on."""
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=1, poll_interval=0.2, start_from_trigger=True)
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = _trigger_ti()
    if still_deferred is not None:
        trigger._still_deferred = lambda unsure=False, timeout_s=None: still_deferred

    async def cancel_while_it_watches():
        running = asyncio.ensure_future(trigger.run().__anext__())
        deadline = time.monotonic() + 60
        while not (trigger.job_id and backend.is_running(trigger.job_id)):  # submitted and started
            assert time.monotonic() < deadline and not running.done()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # now polling
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(cancel_while_it_watches())
    (job,) = broker.jobs()
    if still_deferred is False:
        assert job.status is JobStatus.CANCELLED and not backend.is_running(job.id)
    else:
        assert job.status is JobStatus.RUNNING and backend.is_running(job.id)
        backend.stop(job.id, timeout_s=10)


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
