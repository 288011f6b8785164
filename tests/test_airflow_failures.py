"""The operator and the trigger when something fails around a training: a clean-up that keeps
failing after the job's end, polls that keep failing past the task's deadline, a task killed while
its job starts, and which failures Airflow retries (``AirflowException``: a request the broker
refuses, a failed job) and which it must not (``AirflowFailException``: a job a user cancelled, a
triggerer that cannot see the job)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from unittest import mock

import pytest
from airflow.exceptions import AirflowException
from airflow.sdk.exceptions import AirflowFailException
from test_airflow_tasks import _FakeTI
from test_sidecar import wait_for

from airflow_elastic_gpu.backends import BackendError
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger
from airflow_elastic_gpu.triggers.watcher import CLEANUP_TRIES, JobWatcher


def _ended_job(broker):
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("ended", "python train.py", 1, 2, total_steps=10))
    broker.ack(job.id, 1)
    return broker.finish(job.id, 0, {"final": True, "step": 10})


def first_event_once_mended(trigger, mend):
    """``trigger``'s first event, which must not come in its first second (several polls that cannot
    follow the job), and comes once ``mend()`` has mended what kept it from the job."""
    async def follow():
        first = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(1.0)
        assert not first.done()
        mend()
        return await asyncio.wait_for(first, 30)

    return asyncio.run(follow())


@pytest.fixture
def failing_stop(monkeypatch):
    """``LocalBackend.stop`` raises what a read-only disk raises (an ``OSError``, not a
    ``BackendError``) while the returned list of calls is not closed (``calls.append(None)`` ends the
    failures, so the fixtures' own clean-up stops what is left)."""
    calls: list[str | None] = []
    real = LocalBackend.stop

    def stop(self, job_id, **kwargs):
        if None not in calls:
            calls.append(job_id)
            raise OSError(30, "Read-only file system")
        return real(self, job_id, **kwargs)

    monkeypatch.setattr(LocalBackend, "stop", stop)
    yield calls
    calls.append(None)


def test_a_trigger_fires_an_ended_jobs_end_when_its_clean_up_keeps_failing(worker_env, failing_stop, capfd):
    """The trigger retried a failed clean-up for ever: the job had ended, the task stayed deferred."""
    broker, _, _ = worker_env
    job = _ended_job(broker)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.05)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None))
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
    assert event.payload == {"job_id": job.id, "status": "succeeded", "reason": job.reason}
    assert failing_stop == [job.id] * CLEANUP_TRIES
    logged = "".join(capfd.readouterr())  # the trigger's log (Airflow's structlog) goes to the console
    assert f"clean-up failed: [Errno 30] Read-only file system ({CLEANUP_TRIES} tries)" in logged
    assert "its end is reported all the same; what the clean-up left behind is to be removed by hand" in logged
    assert op.execute_complete({"ti": _FakeTI()}, event.payload)["exit_code"] == 0


def test_a_task_in_the_worker_returns_its_jobs_result_when_the_clean_up_keeps_failing(worker_env, failing_stop):
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 20", total_steps=20,
                                 virtual_gpus=2, poll_interval=0.1, deferrable=False)
    result = op.execute({"ti": _FakeTI()})
    assert result["final_step"] == 20 and broker.job(result["job_id"]).status is JobStatus.SUCCEEDED
    assert failing_stop == [result["job_id"]] * CLEANUP_TRIES


@pytest.mark.parametrize("hangs", [False, True], ids=["polls fail", "a poll hangs"])
def test_a_deferred_tasks_deadline_holds_while_its_polls_keep_failing(worker_env, monkeypatch, hangs):
    """The deadline was checked only after a poll that worked: a broker or cluster API that kept
    failing put the time-out off for as long as it failed, and a poll stuck on a database lock for
    as long as it was stuck (now one is given up after ``POLL_TIMEOUT_S``)."""
    import threading

    from airflow_elastic_gpu.triggers import training

    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("long", "python train.py", 1, 2, total_steps=10**6))
    failing, released = [True], threading.Event()
    real_poll = JobWatcher.poll
    monkeypatch.setattr(training, "POLL_TIMEOUT_S", 0.2)

    def poll(self):
        if failing[0] and hangs:
            released.wait(60)  # a lock held by a stuck client
        elif failing[0]:
            raise RuntimeError("the cluster API is unreachable")
        return real_poll(self)

    monkeypatch.setattr(JobWatcher, "poll", poll)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10**6, poll_interval=0.05)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None, deadline_s=time.time() - 1))

    async def follow():
        task = asyncio.create_task(trigger.run().__anext__())
        deadline = time.monotonic() + 20
        while broker.job(job.id).status is not JobStatus.CANCELLED:
            assert time.monotonic() < deadline, "the job was not timed out while the polls failed"
            assert not task.done()
            await asyncio.sleep(0.05)
        # a few stuck polls at most, in daemon threads: none piled up in the loop's shared executor
        assert sum(t.name == "elastic-gpu_poll" for t in threading.enumerate()) <= training.MAX_UNANSWERED
        failing[0] = False
        released.set()
        return await asyncio.wait_for(task, 20)

    event = asyncio.run(follow())
    assert event.payload["status"] == "cancelled" and event.payload["reason"].startswith("execution_timeout")
    with pytest.raises(AirflowException) as raised:  # a time-out is retried, as Airflow's own
        op.execute_complete({"ti": _FakeTI()}, event.payload)
    assert not isinstance(raised.value, AirflowFailException)


def test_a_job_a_user_cancelled_fails_its_task_without_retries(worker_env):
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("stopped", "python train.py", 1, 2, total_steps=10))
    broker.cancel(job.id, "cancelled from the CLI")
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10)
    event = {"job_id": job.id, "status": "cancelled", "reason": "cancelled from the CLI"}
    with pytest.raises(AirflowFailException, match="cancelled: cancelled from the CLI"):
        op.execute_complete({"ti": _FakeTI()}, event)


@pytest.mark.parametrize("deferrable", [False, True])
def test_a_request_the_broker_refuses_is_retried(worker_env, deferrable):
    """More GPUs than the pool has now: the pool counts schedulable, healthy GPUs, and a drain ends,
    so the task's retries apply (from the worker, or from the triggerer)."""
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 3", total_steps=3,
                                 min_gpus=3, max_gpus=3, virtual_gpus=2, deferrable=deferrable,
                                 start_from_trigger=deferrable)
    with pytest.raises(AirflowException, match=r"min_gpus=3 is more than GPU pool 'default' has \(2\)") as raised:
        if not deferrable:
            op.execute({"ti": _FakeTI()})
        else:
            trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=None,
                                                                  labels=op.task_labels({"ti": _FakeTI()})))
            trigger.task_instance = _FakeTI()
            trigger.task_instance.id = "0193a1b2-try-1"
            event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
            assert event.payload["job_id"] is None
            op.execute_complete({"ti": _FakeTI()}, event.payload)
    assert not isinstance(raised.value, AirflowFailException)
    assert broker.jobs() == []


def test_a_job_the_triggerer_cannot_see_is_followed_by_the_worker(worker_env):
    """The triggerer's broker is not the worker's (its connection could not be read for minutes): the
    job ran on in the worker's, watched by nobody; then it was cancelled, throwing a healthy
    training away. The worker follows it now, as with ``deferrable=False``, and the task gets its result."""
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 20", total_steps=20,
                                 virtual_gpus=2, poll_interval=0.1, deferrable=False)
    ti = _FakeTI()
    with mock.patch.object(op, "_wait_in_worker", side_effect=lambda watcher, context: None):
        op.execute({"ti": ti})  # submitted and started, as before a deferral
    job_id = ti.xcom["job_id"]
    event = {"job_id": job_id, "status": "error", "reason": f"unknown job {job_id!r} in the triggerer's broker"}
    result = op.execute_complete({"ti": ti}, event)
    assert result["job_id"] == job_id and result["final_step"] == 20
    assert broker.job(job_id).status is JobStatus.SUCCEEDED
    # a job the worker's broker does not have either: the task fails, as before
    with pytest.raises(AirflowFailException, match="the triggerer could not follow training job"):
        op.execute_complete({"ti": _FakeTI()}, {**event, "job_id": "no-such-job"})


def test_a_job_the_worker_took_back_is_cancelled_at_the_tries_deadline(worker_env):
    """Airflow restarts ``execution_timeout`` when a deferred task resumes: a job the worker took
    back from the triggerer five hours into a six-hour try ran up to six more. It is cancelled at
    the try's deadline (the trigger's), and the task retried as on a time-out."""
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000", total_steps=100000,
                                 virtual_gpus=2, poll_interval=0.1, deferrable=False)
    ti = _FakeTI()
    with mock.patch.object(op, "_wait_in_worker", side_effect=lambda watcher, context: None):
        op.execute({"ti": ti})
    job_id = ti.xcom["job_id"]
    event = {"job_id": job_id, "status": "error", "reason": "unknown job in the triggerer's broker",
             "deadline_s": time.time() + 1.0}
    with pytest.raises(AirflowException, match="execution_timeout") as raised:
        op.execute_complete({"ti": ti}, event)
    assert not isinstance(raised.value, AirflowFailException)
    ended = broker.job(job_id)
    assert ended.status is JobStatus.CANCELLED and ended.reason.startswith("execution_timeout")


def test_a_task_killed_while_its_job_starts_cancels_that_job(worker_env, monkeypatch):
    """The job's id was known to ``on_kill`` only once its processes had started: a task killed
    meanwhile (a start that waits for the previous try's trainer to stop) left the job behind."""
    broker, backend, trainer = worker_env
    release, starting = threading.Event(), threading.Event()
    real_start = LocalBackend.start

    def slow_start(self, job, **kwargs):
        starting.set()
        release.wait(30)
        return real_start(self, job, **kwargs)

    monkeypatch.setattr(LocalBackend, "start", slow_start)
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=2, poll_interval=0.1)
    outcome: list[BaseException | None] = []

    def execute() -> None:
        try:
            op.execute({"ti": _FakeTI()})
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome.append(exc)

    worker = threading.Thread(target=execute)
    worker.start()
    try:
        assert starting.wait(30)
        (job,) = broker.jobs()
        op.on_kill()
        assert broker.job(job.id).status is JobStatus.CANCELLED and broker.job(job.id).reason == "task killed"
    finally:
        release.set()
        worker.join(60)
    assert outcome  # deferred: its trigger fires the cancelled end at once
    assert not backend.is_running(job.id)  # the start found its job cancelled and stopped what it made
    wait_for(lambda: broker.job(job.id).in_use_gpus == (), 60, "the cancelled job's GPUs to be free")


def test_a_task_in_the_worker_retries_a_poll_that_fails(worker_env, monkeypatch):
    """A cluster API that failed one poll failed the task in the worker (the trigger retried it),
    and its job trained on with nobody following it."""
    broker, _, trainer = worker_env
    # what a client library raises as it is, not only the backend's own errors
    failures = [ConnectionRefusedError(111, "Connection refused"), BackendError("the cluster API is unreachable")]
    real_poll = JobWatcher.poll

    def poll(self):
        if failures:
            raise failures.pop()
        return real_poll(self)

    monkeypatch.setattr(JobWatcher, "poll", poll)
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 20", total_steps=20,
                                 virtual_gpus=2, poll_interval=0.1, deferrable=False)
    result = op.execute({"ti": _FakeTI()})
    assert failures == [] and result["final_step"] == 20
    assert broker.job(result["job_id"]).status is JobStatus.SUCCEEDED


def test_a_cleared_tasks_old_trigger_leaves_the_job_its_new_try_reattached_to(worker_env):
    """A deferred task is cleared: its new try may reattach to the running job (same key) before the
    old trigger's ``on_kill`` runs; the old trigger cancelled it then, and the new try, which
    follows it, failed. A job is the try's that submitted it or last reattached to it."""
    from test_airflow_tasks import _trigger_ti

    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    key = "sft/train/manual__1/-1"
    first = broker.submit(JobSpec("t", "python train.py", 1, 2, total_steps=10**6, key=key, attempt="try-1"))
    broker.ack(first.id, 1)
    again = broker.submit(JobSpec("t", "python train.py", 1, 2, total_steps=10**6, key=key, attempt="try-2"))
    assert again.id == first.id  # reattached: the job is try 2's now
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10**6)
    old = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=first.id, labels=None))
    old.task_instance = _trigger_ti(ti_id="try-1")
    old._kill("task instance killed by a user while deferred")
    assert broker.job(first.id).status is JobStatus.RUNNING
    assert broker.cancel(first.id, "old try", attempt="try-1").status is JobStatus.RUNNING
    new = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=first.id, labels=None))
    new.task_instance = _trigger_ti(ti_id="try-2")
    new._kill("task instance killed by a user while deferred")  # the try that follows it may stop it
    assert broker.job(first.id).status is JobStatus.CANCELLED
    # a cancel that names no try (the CLI, an administrator) always cancels
    other = broker.submit(JobSpec("u", "python train.py", 1, 1, total_steps=10, attempt="try-9"))
    assert broker.cancel(other.id, "cancelled from the CLI").status is JobStatus.CANCELLED


def test_a_worker_try_leaves_the_job_a_later_try_reattached_to(worker_env, monkeypatch):
    """The operator submits with its try too: a killed earlier try (its on_kill) leaves the job the
    next try follows, and a deferred old trigger past its deadline stops acting on it rather than
    cancel it, or poll without a pause."""
    from airflow.sdk.exceptions import TaskDeferred

    broker, _, trainer = worker_env
    ops, tis = [], []
    for try_id in ("try-1", "try-2"):
        op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                     total_steps=100000, virtual_gpus=2, poll_interval=0.1)
        ti = _FakeTI()
        ti.id = try_id
        with pytest.raises(TaskDeferred) as deferred:
            op.execute({"ti": ti})
        ops.append(op)
        tis.append(ti)
    job_id = tis[0].xcom["job_id"]
    assert tis[1].xcom["job_id"] == job_id  # reattached
    ops[0].on_kill()
    assert broker.job(job_id).status is JobStatus.RUNNING
    polls = []
    real_poll = JobWatcher.poll
    monkeypatch.setattr(JobWatcher, "poll", lambda self: polls.append(None) or real_poll(self))
    old = deferred.value.trigger  # try 2's trigger, made again as try 1's with a deadline passed
    kwargs = {**old.serialize()[1], "deadline_s": time.time() - 1}
    stale = ElasticTrainingTrigger(**kwargs)
    stale.task_instance = tis[0]

    async def follow_a_while():
        task = asyncio.create_task(stale.run().__anext__())
        await asyncio.sleep(1.5)
        assert not task.done()
        task.cancel()

    asyncio.run(follow_a_while())
    assert broker.job(job_id).status is JobStatus.RUNNING and stale.deadline_s is None
    assert len(polls) <= 20, f"{len(polls)} polls in 1.5 s at a 0.1 s interval"
    ops[1].on_kill()  # the try that follows it may stop it
    assert broker.job(job_id).status is JobStatus.CANCELLED


def test_a_deferred_task_past_its_deadline_fails_for_a_retry_when_the_triggerer_cannot_reach_the_broker(
        worker_env, monkeypatch):
    """Every poll and every cancel from the triggerer fails (its broker connection is broken): the
    trigger fired nothing and the task stayed deferred for ever, Airflow not enforcing
    ``execution_timeout`` while deferred. It fires an error after a few tries now, and the worker
    cancels the job through its own broker and fails the task for a retry, as a time-out."""
    from airflow_elastic_gpu.triggers.training import TIME_OUT_TRIES

    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("long", "python train.py", 1, 2, total_steps=10**6))
    tries = []

    def unreachable(self, *args, **kwargs):
        tries.append(1)
        raise RuntimeError("could not connect to the broker's database")

    monkeypatch.setattr(JobWatcher, "poll", unreachable)
    monkeypatch.setattr(ElasticTrainingTrigger, "_time_out", unreachable)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10**6, poll_interval=0.05)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None, deadline_s=time.time() - 1))
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 20))
    assert event.payload["status"] == "error" and event.payload["timed_out"] is True
    assert event.payload["reason"].startswith("execution_timeout") and "could not connect" in event.payload["reason"]
    assert len(tries) == 2 * TIME_OUT_TRIES  # a poll and a cancel each time
    assert broker.job(job.id).status is JobStatus.RUNNING  # the triggerer could not end it
    with pytest.raises(AirflowException) as raised:
        op.execute_complete({"ti": _FakeTI()}, event.payload)
    assert not isinstance(raised.value, AirflowFailException)
    cancelled = broker.job(job.id)
    assert cancelled.status is JobStatus.CANCELLED and cancelled.reason.startswith("execution_timeout")


def test_a_job_its_tasks_on_kill_cancelled_fails_the_task_for_a_retry(worker_env):
    """Airflow kills a task (``on_kill``) when a user marks it failed, but also when its worker shuts
    down or loses its heartbeats: the job's cancel by on_kill failed the task with no retry, and
    the training was thrown away."""
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("killed", "python train.py", 1, 2, total_steps=10))
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, deferrable=False)
    op._job_id = job.id
    op.on_kill()
    cancelled = broker.job(job.id)
    assert cancelled.status is JobStatus.CANCELLED
    with pytest.raises(AirflowException, match="cancelled: task killed") as raised:
        op._result(cancelled, {"ti": _FakeTI()})
    assert not isinstance(raised.value, AirflowFailException)


def test_a_trigger_cancelled_while_its_triggerer_stops_does_not_wait_for_ever_for_the_task_state(
        tmp_path, monkeypatch):
    """A triggerer shutting down cancels its triggers after it stopped reading its supervisor's
    answers: the question whether the task is still deferred blocked for ever, and the triggerer's
    shutdown with it, until the supervisor's SIGKILL. Unanswered, it is taken as "still deferred"
    (the job goes on) after STATE_QUERY_TIMEOUT_S."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from test_airflow_tasks import _trigger_ti

    from airflow_elastic_gpu.triggers import training

    never = threading.Event()
    monkeypatch.setattr(RuntimeTaskInstance, "get_ti_count", staticmethod(lambda **kw: never.wait()))
    monkeypatch.setattr(training, "STATE_QUERY_TIMEOUT_S", 0.5)
    trigger = ElasticTrainingTrigger("some-job", "elastic_gpu_missing_conn", 0.2, "local", str(tmp_path / "jobs"))
    trigger.task_instance = _trigger_ti()
    started = time.monotonic()
    assert trigger._still_deferred(unsure=True) is True
    assert trigger._still_deferred(unsure=False) is False
    assert time.monotonic() - started < 5
    never.set()


def test_a_task_started_from_the_triggerer_sends_no_max_tries(worker_env, monkeypatch):
    """The triggerer builds its task instance without ``max_tries`` (it reads 0 for every try, a
    cleared one's too): sent with the job, a cleared task's new try got the old success back
    rather than training again. The worker's task instance has the real one."""
    from types import SimpleNamespace

    from airflow_elastic_gpu.triggers import submit
    from airflow_elastic_gpu.triggers.task_instance import max_tries_of

    sent = []
    monkeypatch.setattr(submit, "submit_and_start", lambda broker, backend, spec, **kw: sent.append(spec) or
                        SimpleNamespace(job=None))
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, start_from_trigger=True,
                                 virtual_gpus=2)
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = SimpleNamespace(id="try-2", dag_id="sft", task_id="train", run_id="manual__1",
                                            map_index=-1, try_number=2, max_tries=0)
    trigger._submit()
    assert sent[0].attempt == "try-2" and sent[0].max_tries is None
    assert max_tries_of(SimpleNamespace(max_tries=3)) == 3 and max_tries_of(SimpleNamespace()) is None


def test_a_trigger_whose_connection_cannot_be_read_for_a_moment_follows_the_job_once_it_can(worker_env, monkeypatch,
                                                                                              tmp_path):
    """Airflow 3 reports a connection it cannot read for a moment as not defined: the triggerer's
    broker was then the [elastic_gpu] section's, which has no such job, and the trigger fired an
    error at once, on which the worker cancelled a healthy training and failed its task for good."""
    broker, _, _ = worker_env
    job = _ended_job(broker)
    real_url = os.environ["AIRFLOW_ELASTIC_GPU_BROKER_URL"]
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'fallback.db'}")
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.1)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None))
    # several polls find no such job; then the connection is read again
    event = first_event_once_mended(trigger, lambda: monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", real_url))
    assert event.payload["status"] == "succeeded" and event.payload["job_id"] == job.id


def test_a_task_of_airflows_longest_ids_gets_a_job_and_the_same_key_from_the_trigger(worker_env):
    """dag, task and run ids of up to 250 characters each made a key past the broker's 512: the
    task failed on every try with "key must be at most 512 characters"."""
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_elastic_gpu.triggers.task_instance import task_key

    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    ti = _FakeTI()
    ti.dag_id, ti.task_id, ti.run_id, ti.map_index = "d" * 250, "group." + "t" * 244, "manual__" + "r" * 242, 7
    op = ElasticTrainingOperator(task_id=ti.task_id, command="python train.py", total_steps=10)
    with pytest.raises(TaskDeferred):
        op.execute({"ti": ti})
    (job,) = broker.jobs()
    assert job.key == task_key(ti) and len(job.key) <= 475 and job.key.startswith(f"{'d' * 250}/group.ttt")
    other = _FakeTI()
    other.dag_id, other.task_id, other.run_id, other.map_index = ti.dag_id, ti.task_id, ti.run_id, 8
    assert task_key(other) != job.key  # the hash is the whole key's
    assert task_key(_FakeTI()) == "retry_dag/train/manual__1/-1"  # a key that fits stays as it was


def test_a_non_deferrable_task_cleared_with_its_max_tries_as_they_were_trains_again(worker_env):
    """A retry of a task whose job succeeded gets that success back; a clear trains again, also
    one that left ``max_tries`` as it was: the operator sends its DAG run's ``clear_number``."""
    from types import SimpleNamespace

    broker, _backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 10", total_steps=10,
                                 virtual_gpus=2, poll_interval=0.2, deferrable=False)

    def run(ti_id: str, clear_number: int) -> str:
        ti = _FakeTI()
        ti.id, ti.max_tries, ti.try_number = ti_id, 1, 1
        return op.execute({"ti": ti, "dag_run": SimpleNamespace(clear_number=clear_number)})["job_id"]

    first = run("try-1", 0)
    assert run("try-2", 0) == first  # a retry: the success back, not trained again
    assert run("try-3", 1) != first  # cleared: trained again
    assert [j.status for j in broker.jobs()] == [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED]
