"""Jobs that no task follows any more (a deferred task marked failed while no triggerer ran, a task
failed after its worker was lost): every trigger's poll checks its pool and cancels them, at the
second check that finds their task instance ended in Airflow, and never on a guess."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
from test_sidecar import wait_for

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.triggers import orphans
from airflow_elastic_gpu.triggers.orphans import OrphanCheck, TaskId, task_of
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger


def operator_job(broker, run_id: str = "manual__1", task_id: str = "train", map_index: int = -1):
    """A running job as the operator submits it (``dag_id/task_id/run_id/map_index``, family ``dag_id.task_id``)."""
    job = broker.submit(JobSpec(f"etl.{task_id}", "python train.py", 1, 1, total_steps=100,
                                key=f"etl/{task_id}/{run_id}/{map_index}", family=f"etl.{task_id}",
                                attempt=f"try-{run_id}-{map_index}"))
    return broker.start(job.id, "ref")


@dataclass
class Airflow:
    """Airflow's answer of task states (``RuntimeTaskInstance.get_task_states``), and the questions."""

    states: dict[str, dict[str, str | None]] = field(default_factory=dict)
    asked: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    down: bool = False

    def __call__(self, dag_id, task_ids, run_ids):
        self.asked.append((dag_id, task_ids, run_ids))
        if self.down:
            raise TimeoutError("no answer from the supervisor")
        return {run: tasks for run, tasks in self.states.items() if run in run_ids}


class StopRecorder:
    name = "local"

    def __init__(self) -> None:
        self.stopped: list[str] = []

    def stop(self, job_id: str, succeeded: bool = False, timeout_s: float | None = None) -> None:
        self.stopped.append(job_id)


def test_the_task_of_a_job_is_read_from_the_operators_key_and_family(pool):
    assert task_of(operator_job(pool)) == TaskId("etl", "train", "manual__1", -1)
    assert task_of(operator_job(pool, map_index=3)).state_key == "train_3"
    cli = pool.submit(JobSpec("etl.train", "python train.py", 1, 1, total_steps=10))  # a uuid key
    other = pool.submit(JobSpec("x", "python train.py", 1, 1, total_steps=10, key="a/b/c/1", family="x"))
    cut = pool.submit(JobSpec("y", "python train.py", 1, 1, total_steps=10, key="a/b/c#0123456789abcdef/1",
                              family="a.b"))
    assert task_of(cli) is None and task_of(other) is None and task_of(cut) is None


@pytest.mark.parametrize("state", ["failed", "success", "upstream_failed", "removed", "skipped"])
def test_a_job_whose_task_ended_is_cancelled_at_the_second_check(pool, state):
    job = operator_job(pool)
    followed = operator_job(pool, run_id="manual__2")
    airflow = Airflow({"manual__1": {"train": state}, "manual__2": {"train": "deferred"}})
    backend, check = StopRecorder(), OrphanCheck(interval_s=60)
    assert check.run(pool, backend, "default", airflow, now_s=0.0) == []  # seen once: a suspect
    assert check.run(pool, backend, "default", airflow, now_s=30.0) == []  # not due yet
    assert pool.job(job.id).status is JobStatus.RUNNING
    (cancelled,) = check.run(pool, backend, "default", airflow, now_s=60.0)
    assert cancelled.id == job.id and pool.job(job.id).status is JobStatus.CANCELLED
    assert f"etl.train (run manual__1) is {state}" in pool.job(job.id).reason
    assert pool.job(followed.id).status is JobStatus.RUNNING
    wait_for(lambda: backend.stopped == [job.id], 10, "the orphan's processes to be stopped")
    assert airflow.asked[-1] == ("etl", ["train"], ["manual__1", "manual__2"])  # one question per task


@pytest.mark.parametrize("answer", [
    {"manual__1": {"train": "running"}},
    {"manual__1": {"train": "deferred"}},  # its triggerer is down: the task still follows it
    {"manual__1": {"train": "up_for_retry"}},  # the retry reattaches
    {"manual__1": {"train": None}},  # cleared: the new try reattaches
    {"manual__1": {"train_3": "failed"}},  # another map index of the task
    {},  # Airflow does not know it (another Airflow on the broker, a deleted DAG run)
])
def test_a_job_whose_task_may_still_follow_it_is_left_alone(pool, answer):
    job = operator_job(pool)
    check = OrphanCheck(interval_s=1)
    for now_s in range(5):
        assert check.run(pool, None, "default", Airflow(answer), now_s=float(now_s)) == []
    assert pool.job(job.id).status is JobStatus.RUNNING


def test_an_end_seen_once_or_not_answered_cancels_nothing(pool):
    """A user marks the task failed, then clears it before the next check; and an Airflow that
    does not answer: nobody is cancelled on a guess."""
    job = operator_job(pool)
    airflow, check = Airflow({"manual__1": {"train": "failed"}}), OrphanCheck(interval_s=1)
    check.run(pool, None, "default", airflow, now_s=0.0)
    airflow.states = {"manual__1": {"train": "queued"}}  # cleared: a new try
    check.run(pool, None, "default", airflow, now_s=1.0)
    airflow.states = {"manual__1": {"train": "failed"}}
    assert check.run(pool, None, "default", airflow, now_s=2.0) == []  # seen once again
    airflow.down = True
    assert check.run(pool, None, "default", airflow, now_s=3.0) == []
    assert pool.job(job.id).status is JobStatus.RUNNING
    airflow.down = False
    assert check.run(pool, None, "default", airflow, now_s=4.0) == []  # the check before had no answer
    assert [j.id for j in check.run(pool, None, "default", airflow, now_s=5.0)] == [job.id]


def test_a_mapped_tasks_state_is_never_taken_for_another_tasks():
    """Airflow's answer keys a mapped task's instances ``<task>_<index>``: a task named ``train_1``
    and index 1 of a mapped ``train``, asked together, share a key (the later row wins), so a
    live ``train_1`` could read as its neighbour's success. One question per task."""
    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker("sqlite://")
    broker.register_node("n0", 4)
    live = operator_job(broker, task_id="train_1")
    ended = operator_job(broker, task_id="train", map_index=1)
    rows = {"train": [(1, "success")], "train_1": [(-1, "running")]}

    def answer(dag_id, task_ids, run_ids):  # as Airflow's route builds it: one dict per run, later rows win
        states = {}
        for task_id in sorted(rows, reverse=True):  # train_1's row first, then train's overwrites the key
            for index, state in rows[task_id] if task_id in task_ids else ():
                states[task_id if index < 0 else f"{task_id}_{index}"] = state
        return {"manual__1": states}

    check = OrphanCheck(interval_s=1)
    for now_s in (0.0, 1.0):
        cancelled = check.run(broker, None, "default", answer, now_s=now_s)
    assert [j.id for j in cancelled] == [ended.id] and broker.job(live.id).status is JobStatus.RUNNING


def test_a_job_a_new_try_reattached_to_between_checks_is_left_alone(pool):
    """The task was marked failed, then cleared; its new try reattached to the job (the job is that
    try's now) while Airflow still answered with the old state: not cancelled."""
    job = operator_job(pool)
    airflow, check = Airflow({"manual__1": {"train": "failed"}}), OrphanCheck(interval_s=1)
    check.run(pool, None, "default", airflow, now_s=0.0)
    pool.submit(JobSpec("etl.train", "python train.py", 1, 1, total_steps=100, key="etl/train/manual__1/-1",
                        family="etl.train", attempt="try-2"))  # the new try reattaches
    assert check.run(pool, None, "default", airflow, now_s=1.0) == []
    assert pool.job(job.id).status is JobStatus.RUNNING


def test_the_question_is_the_task_sdks_own(monkeypatch):
    """The states are asked with the Task SDK's message, through the process's supervisor."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import GetTaskStates, TaskStatesResult

    sent = []

    class Comms:
        def send(self, msg):
            sent.append(msg)
            return TaskStatesResult(task_states={"manual__1": {"train": "failed"}})

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Comms(), raising=False)
    assert orphans.airflow_task_states("etl", ["train"], ["manual__1"]) == {"manual__1": {"train": "failed"}}
    (msg,) = sent
    assert isinstance(msg, GetTaskStates) and (msg.dag_id, msg.task_ids, msg.run_ids) == ("etl", ["train"], ["manual__1"])


def test_a_triggers_poll_cancels_and_stops_an_orphan_of_its_pool(worker_env, monkeypatch):
    """A real job whose task was marked failed while no triggerer ran: another task's trigger, at
    its polls, cancels it and stops its processes; the GPUs go back once its trainer has stopped."""
    broker, backend, trainer = worker_env
    broker.register_node("localhost", 2)
    orphan = broker.submit(JobSpec("etl.train", f"{sys.executable} {trainer} x 100000", 1, 1, total_steps=100000,
                                   key="etl/train/manual__1/-1", family="etl.train", attempt="try-1"))
    orphan = broker.start(orphan.id, backend.start(orphan))
    followed = broker.submit(JobSpec("etl.eval", f"{sys.executable} {trainer} x 100000", 1, 1, total_steps=100000,
                                     key="etl/eval/manual__1/-1", family="etl.eval", attempt="try-2"))
    followed = broker.start(followed.id, backend.start(followed))
    wait_for(lambda: broker.job(orphan.id).steps_done > 0, 60, "the orphan to train")
    airflow = Airflow({"manual__1": {"train": "failed", "eval": "deferred"}})
    monkeypatch.setattr(orphans, "airflow_task_states", airflow)
    monkeypatch.setattr(orphans, "ORPHAN_CHECK_S", 0.0)
    monkeypatch.setattr(orphans, "_CHECKS", {})
    trigger = ElasticTrainingTrigger(followed.id, "elastic_gpu_missing_conn", 0.2, "local", str(backend.work_dir))
    assert trigger._poll().status is JobStatus.RUNNING  # the first check: a suspect
    wait_for(lambda: orphans._CHECKS and not next(iter(orphans._CHECKS.values())).lock.locked()
             and next(iter(orphans._CHECKS.values())).suspects, 30, "the first check")
    assert trigger._poll().status is JobStatus.RUNNING  # the second, in a thread of its own
    wait_for(lambda: broker.job(orphan.id).status is JobStatus.CANCELLED, 30, "the orphan to be cancelled")
    wait_for(lambda: not backend.is_running(orphan.id) and broker.job(orphan.id).in_use_gpus == (), 60,
             "the orphan's trainer to stop and its GPU to be freed")
    assert broker.job(followed.id).status is JobStatus.RUNNING and backend.is_running(followed.id)


def test_an_orphan_started_in_another_namespace_is_stopped_there(tmp_path):
    """A job another task started in namespace ``team-b`` is found orphaned by a trigger whose
    backend is set for ``ml``: its pod and token Secret are deleted in ``team-b``. They were
    looked for in ``ml`` and left behind."""
    import dataclasses

    from test_kubernetes import FakeCoreV1, Listing, config

    from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend
    from airflow_elastic_gpu.broker.service import GpuBroker

    class Namespaced(FakeCoreV1):
        def __init__(self) -> None:
            super().__init__()
            self.where: list[tuple[str, str]] = []

        def delete_namespaced_pod(self, name, namespace):
            assert namespace == "team-b", namespace
            self.where.append(("pod", namespace))
            super().delete_namespaced_pod(name, namespace)

        def delete_namespaced_secret(self, name, namespace):
            assert namespace == "team-b", namespace
            self.where.append(("secret", namespace))
            super().delete_namespaced_secret(name, namespace)

        def list_namespaced_pod(self, namespace, label_selector):
            return super().list_namespaced_pod(namespace, label_selector) if namespace == "team-b" else Listing([])

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("gpu-node-0", 4)
    api = Namespaced()
    team_b = KubernetesBackend(dataclasses.replace(config(), namespace="team-b"), broker, api)
    job = broker.submit(JobSpec("etl.train", "python train.py", 1, 1, total_steps=100, backend="kubernetes",
                                key="etl/train/manual__1/-1", family="etl.train", attempt="try-1"))
    job = broker.start(job.id, team_b.start(job))
    assert job.backend_ref.startswith("kubernetes:team-b/") and len(api.pods) == 1 and len(api.secrets) == 1
    ml = KubernetesBackend(config(), broker, api)
    assert ml.config.namespace == "ml"
    check, airflow = OrphanCheck(interval_s=1), Airflow({"manual__1": {"train": "failed"}})
    check.run(broker, ml, "default", airflow, now_s=0.0)
    (cancelled,) = check.run(broker, ml, "default", airflow, now_s=1.0)
    assert cancelled.id == job.id
    wait_for(lambda: not api.pods and not api.secrets, 10, "the orphan's pod and Secret to be deleted in team-b")
    assert ("pod", "team-b") in api.where and ("secret", "team-b") in api.where
    broker.engine.dispose()


def test_a_workers_wait_cancels_an_orphan_of_its_pool(worker_env, monkeypatch):
    """``deferrable=False``: the task waits in its worker, and no trigger may poll the pool at all.
    A job whose worker died (its task then failed without a retry) trained on unseen: only a
    trigger's poll looked for it."""
    from test_airflow_tasks import _FakeTI

    from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

    broker, backend, trainer = worker_env
    broker.register_node("localhost", 2)
    orphan = broker.submit(JobSpec("etl.train", f"{sys.executable} {trainer} x 100000", 1, 1, total_steps=100000,
                                   key="etl/train/manual__1/-1", family="etl.train", attempt="try-1"))
    orphan = broker.start(orphan.id, backend.start(orphan))
    wait_for(lambda: broker.job(orphan.id).steps_done > 0, 60, "the orphan to train")
    airflow = Airflow({"manual__1": {"train": "failed"}})
    monkeypatch.setattr(orphans, "airflow_task_states", airflow)
    monkeypatch.setattr(orphans, "ORPHAN_CHECK_S", 0.0)
    monkeypatch.setattr(orphans, "_CHECKS", {})
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 60", total_steps=60,
                                 min_gpus=1, max_gpus=1, poll_interval=0.2, deferrable=False)
    ti = _FakeTI()  # retry_dag.train of another run: a task of the pool that waits in its worker
    ti.run_id = "manual__2"
    op.execute({"ti": ti})
    assert broker.job(ti.xcom["job_id"]).status is JobStatus.SUCCEEDED
    wait_for(lambda: broker.job(orphan.id).status is JobStatus.CANCELLED, 30, "the orphan to be cancelled")
    assert "etl" in [dag for dag, _tasks, _runs in airflow.asked]
    wait_for(lambda: not backend.is_running(orphan.id), 60, "the orphan's trainer to stop")
