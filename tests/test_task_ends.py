"""What becomes of a training task's job when Airflow ends the task another way than through the
job: a user's action on a deferred task (the triggerer cancels ``run`` with its user-action
message, then calls ``on_kill``), a trigger moved to another triggerer whose task state cannot be
read, an ``on_kill`` whose stop must not wait for the event loop's busy executor, a triggerer that
cannot make its clients (the deferral ends), and a last try that fails after its job started."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time

import pytest
from airflow.exceptions import AirflowException
from airflow.sdk.exceptions import AirflowFailException
from test_airflow_tasks import _FakeTI, _made_again, _started_from_trigger, _trigger_ti
from test_sidecar import wait_for

from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.training import (
    STARTED_TRIGGER_ENDED,
    TRIGGER_KILLED,
    USER_ACTION_CANCEL,
    ElasticTrainingTrigger,
)


def _deferred_on(broker, name: str):
    """A running job of ``broker``, the operator whose task deferred on it, and its trigger."""
    broker.register_node("localhost", 2)
    # no agent heartbeats this job: a long lease, so that a loaded machine (a first poll a minute
    # late, once under make test) does not declare it lost and fire its end before the test acts
    broker.configure_pool(lease_s=3600)
    job = broker.submit(JobSpec(name, "python train.py", 1, 2, total_steps=10**6))
    broker.ack(job.id, 1)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10**6, poll_interval=0.1)
    return job, op, ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None))


async def _mark_failed_while_it_watches(trigger) -> None:
    """What the triggerer does when a user marks the task failed: ``run`` cancelled with the
    user-action message (its CancelledError raised on), then ``on_kill``."""
    running = asyncio.ensure_future(trigger.run().__anext__())
    await asyncio.sleep(0.5)
    running.cancel(USER_ACTION_CANCEL)
    with pytest.raises(asyncio.CancelledError):
        await running
    await trigger.on_kill()


@pytest.mark.parametrize("on_kill", [True, False])
def test_a_user_action_or_a_trigger_timeout_stops_a_started_triggers_job_with_a_retried_reason(worker_env, on_kill):
    """The triggerer cancels ``run`` with its user-action message, then calls ``on_kill`` (a user
    marked the task failed) or not (the trigger timeout of a ``start_from_trigger`` task passed):
    ``run`` took the first for a time-out ("the task's deferral ended without the job (timed
    out)", the reason the broker, the UI and the CLI then showed, the job stopped twice); leaving
    it to ``on_kill`` left the second's job running, followed by nobody."""
    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=1, poll_interval=0.2, start_from_trigger=True)
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = _trigger_ti()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: False  # the user marked it failed: its state is set

    async def mark_failed_while_it_watches():
        running = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.to_thread(wait_for, lambda: trigger.job_id and backend.is_running(trigger.job_id), 60,
                                "the job to start")
        await asyncio.sleep(0.5)  # now polling
        running.cancel(USER_ACTION_CANCEL)  # what the triggerer's cancel_triggers does
        with pytest.raises(asyncio.CancelledError):
            await running
        if on_kill:
            await trigger.on_kill()

    asyncio.run(mark_failed_while_it_watches())
    (job,) = broker.jobs()
    assert job.status is JobStatus.CANCELLED and job.reason == STARTED_TRIGGER_ENDED
    assert not backend.is_running(job.id)
    (cancelled,) = [e.message for e in broker.events(job_id=job.id) if e.kind == "cancelled"]  # once
    assert cancelled.startswith(STARTED_TRIGGER_ENDED)


def test_a_user_action_on_a_deferred_task_cancels_its_job_with_on_kills_reason(worker_env):
    broker, _, _ = worker_env
    job, _, trigger = _deferred_on(broker, "followed")
    trigger.task_instance = _trigger_ti()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: False
    asyncio.run(_mark_failed_while_it_watches(trigger))
    ended = broker.job(job.id)
    assert ended.status is JobStatus.CANCELLED and ended.reason == TRIGGER_KILLED


def test_a_job_whose_trigger_was_killed_without_a_known_task_state_fails_its_task_for_a_retry(worker_env):
    """Airflow 3.3 calls ``on_kill`` on a triggerer whose trigger moved to another one too; a task
    state that cannot be read (no answer from a loaded triggerer's supervisor) is taken for a
    user's action, and the job is cancelled. The other triggerer then fires the cancelled job, and
    its reason failed the task for good: a moved trigger threw a training away."""
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("moved", "python train.py", 1, 2, total_steps=10))
    trigger = ElasticTrainingTrigger(job.id, "elastic_gpu_missing_conn", 0.2, "local", str(worker_env[1].work_dir))
    trigger.task_instance = _trigger_ti()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: unsure  # no answer
    asyncio.run(trigger.on_kill())
    cancelled = broker.job(job.id)
    assert cancelled.status is JobStatus.CANCELLED
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10)
    with pytest.raises(AirflowException, match="task killed while deferred") as raised:
        op._result(cancelled, {"ti": _FakeTI()})
    assert not isinstance(raised.value, AirflowFailException)


def test_a_moved_trigger_whose_supervisor_answers_late_leaves_its_job_running(worker_env, monkeypatch):
    """A loaded triggerer's supervisor says after more than the ordinary question's time that the
    task instance of a trigger given to another triggerer is still deferred: ``on_kill`` waits for
    the answer (in a thread of its own, past Airflow's 30 s for it) and the job goes on. It took no
    answer within 10 s for a user's action and cancelled the training. An answer that never comes
    is still taken for one, after the longer wait."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    from airflow_elastic_gpu.triggers import training

    broker, _, _ = worker_env
    monkeypatch.setattr(training, "STATE_QUERY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(training, "ON_KILL_STATE_QUERY_TIMEOUT_S", 3.0)
    late = lambda **kw: time.sleep(1.0) or 1  # one deferred task instance, after 1 s
    monkeypatch.setattr(RuntimeTaskInstance, "get_ti_count", staticmethod(late))
    job, _op, trigger = _deferred_on(broker, "moved")
    trigger.task_instance = _trigger_ti()
    asyncio.run(trigger.on_kill())
    assert broker.job(job.id).status is JobStatus.RUNNING and not trigger._stopped

    never = threading.Event()
    monkeypatch.setattr(RuntimeTaskInstance, "get_ti_count", staticmethod(lambda **kw: never.wait()))
    started = time.monotonic()
    asyncio.run(trigger.on_kill())
    assert broker.job(job.id).status is JobStatus.CANCELLED and broker.job(job.id).reason == TRIGGER_KILLED
    assert 3.0 <= time.monotonic() - started < 20
    never.set()


def test_a_question_the_stopping_triggerer_cancelled_leaves_the_job_running(worker_env, monkeypatch):
    """A triggerer that shuts down cancels the questions still waiting for its supervisor's answers
    (``concurrent.futures.CancelledError`` in the question's thread), or has lost its supervisor:
    that is no user's action, and ``on_kill``'s stop, still waiting, cancelled the job."""
    import concurrent.futures

    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    broker, _, _ = worker_env
    job, _op, trigger = _deferred_on(broker, "shutdown")
    trigger.task_instance = _trigger_ti()
    for error in (concurrent.futures.CancelledError(), EOFError(), BrokenPipeError()):
        def cancelled(error=error, **kw):
            raise error
        monkeypatch.setattr(RuntimeTaskInstance, "get_ti_count", staticmethod(cancelled))
        asyncio.run(trigger.on_kill())
        assert broker.job(job.id).status is JobStatus.RUNNING, error


def test_stops_of_run_and_on_kill_at_once_stop_the_job_once_and_a_failed_one_is_logged(worker_env, caplog):
    """Airflow cancels a trigger again about every second: ``on_kill`` may start while the stop of
    the cancelled ``run`` still waits for its answer, in its own thread. Both stopped the job (two
    ``backend.stop`` at once); and a stop that failed after its caller stopped waiting said nothing."""
    broker, _, _ = worker_env
    _job, _op, trigger = _deferred_on(broker, "twice")
    trigger.task_instance = _trigger_ti()
    answer = threading.Event()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: answer.wait(5) and False
    kills: list[str] = []
    trigger._kill = lambda reason: kills.append(reason) or True

    async def both() -> None:
        first = asyncio.ensure_future(trigger._stop_unless_deferred("run's", unsure=True))
        await asyncio.sleep(0.2)
        second = asyncio.ensure_future(trigger.on_kill())
        await asyncio.sleep(0.2)
        answer.set()
        await asyncio.gather(first, second)

    asyncio.run(both())
    assert kills == ["run's"] and trigger._stopped

    _, _, failing = _deferred_on(broker, "failing")
    failing.task_instance = _trigger_ti()
    failing._still_deferred = lambda unsure=False, timeout_s=None: False

    def broken(reason):
        raise ConnectionError("the broker's database is away")
    failing._kill = broken
    failing._log = logging.getLogger("trigger")  # Airflow's structlog logger: not in caplog
    with pytest.raises(ConnectionError):
        asyncio.run(failing.on_kill())
    assert "could not stop it (the broker's database is away)" in caplog.text and not failing._stopped


def test_on_kill_stops_the_job_when_the_event_loops_executor_is_busy(worker_env):
    """``on_kill`` has 30 s in Airflow's triggerer; its stop waited in the event loop's default
    executor behind other triggers' blocking polls, and was dropped, never run, when the time ran
    out: the job kept its GPUs with nobody following it."""
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("killed", "python train.py", 1, 2, total_steps=10))
    trigger = ElasticTrainingTrigger(job.id, "elastic_gpu_missing_conn", 0.2, "local", str(worker_env[1].work_dir))
    trigger.task_instance = _trigger_ti()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: False
    busy = threading.Event()

    async def kill_while_the_executor_is_busy():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        loop.run_in_executor(None, busy.wait, 30)  # another trigger's poll, stuck for a while
        try:
            await asyncio.wait_for(trigger.on_kill(), 1.0)  # the triggerer's limit, shortened
        except TimeoutError:
            pass  # as the triggerer does
        busy.set()

    started = time.monotonic()
    asyncio.run(kill_while_the_executor_is_busy())
    assert time.monotonic() - started < 20
    wait_for(lambda: broker.job(job.id).status is JobStatus.CANCELLED, 10, "the job to be cancelled")


def test_a_triggerer_that_cannot_make_its_broker_client_hands_the_job_to_the_worker(worker_env, monkeypatch):
    """A triggerer without the broker's database driver (or with a malformed URL) logged a warning
    at every poll, for ever: the task stayed deferred while its job ran unwatched. The trigger fires
    the reason, and the worker, whose broker has the job, follows it to its end."""
    broker, _, _ = worker_env
    job, op, trigger = _deferred_on(broker, "unwatched")
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", "postgresql+nosuchdriver://db.example/broker")
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
    assert event.payload["status"] == "error" and "cannot make its broker or backend client" in event.payload["reason"]
    assert "nosuchdriver" in event.payload["reason"]
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", broker.url)  # the worker's broker
    followed = []
    monkeypatch.setattr(op, "_wait_in_worker", lambda watcher, context, deadline_s=None: followed.append(watcher.job_id) or {})
    assert op.execute_complete({"ti": _FakeTI()}, event.payload) == {} and followed == [job.id]
    assert broker.job(job.id).status is JobStatus.RUNNING


class _FailWhenAsked:
    """A retry policy that reads the task's context (as Airflow's evaluation gives it): FAIL."""

    def evaluate(self, exception, try_number, max_tries, context=None):
        from airflow.sdk.definitions.retry_policy import RetryAction, RetryDecision

        return RetryDecision(action=RetryAction.FAIL, reason=f"try {context['ti'].try_number}: do not retry")


@pytest.mark.parametrize(("retried", "tries", "policy"), [
    (False, 0, None), (True, 1, None),
    (False, 1, "fail"),  # tries left, but the task's retry_policy fails it on this error
    (False, 1, "context"),  # a policy that reads the context (it was given none, and its error ignored)
])
def test_a_last_try_that_fails_after_its_job_started_cancels_the_job(worker_env, retried, tries, policy):
    """The task's XCom cannot be written (the API server away) once the job has started: Airflow
    calls no on_kill when execute raises, and on the task's last try the job trained on, holding
    its GPUs, with nobody to follow it. A try that will be retried leaves it for the retry."""
    from airflow.sdk.definitions.retry_policy import ExceptionRetryPolicy, RetryAction, RetryRule

    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(
        task_id="train", command=f"{sys.executable} {trainer} x 100000", total_steps=100000, virtual_gpus=1,
        retry_policy={"fail": ExceptionRetryPolicy([RetryRule(OSError, RetryAction.FAIL)]),
                      "context": _FailWhenAsked(), None: None}[policy])
    ti = _FakeTI()
    ti.try_number, ti.max_tries = 1, tries

    def unreachable(key, value):
        raise OSError("the API server cannot be reached")

    ti.xcom_push = unreachable
    with pytest.raises(OSError, match="cannot be reached"):
        op.execute({"ti": ti})
    (job,) = broker.jobs()
    if retried:
        assert broker.job(job.id).status is JobStatus.RUNNING and backend.is_running(job.id)
    else:
        ended = broker.job(job.id)
        assert ended.status is JobStatus.CANCELLED and "last try failed" in ended.reason
        assert not backend.is_running(job.id)


def test_a_stop_that_fails_when_the_trigger_is_cancelled_leaves_the_cancel_and_on_kill_as_they_are(worker_env):
    """The job's stop in ``run`` failed (the broker away for a moment): its error replaced the
    triggerer's CancelledError, so the triggerer took it for a trigger's failure and called no
    ``on_kill``, whose stop would have been tried again."""
    broker, _, _ = worker_env
    job, _, trigger = _deferred_on(broker, "stopped-later")
    trigger.task_instance = _trigger_ti()
    trigger._still_deferred = lambda unsure=False, timeout_s=None: False
    kill = trigger._kill

    def broker_away(reason):
        trigger._kill = kill
        raise OSError("the broker cannot be reached")

    trigger._kill = broker_away
    asyncio.run(_mark_failed_while_it_watches(trigger))
    assert broker.job(job.id).status is JobStatus.CANCELLED


def test_a_subclass_asset_metadata_is_what_the_outlet_events_get(tmp_path):
    from types import SimpleNamespace

    from airflow.sdk import Asset

    class Mine(ElasticTrainingOperator):
        def asset_metadata(self, job):
            return {"model": f"{job.name}-v2"}

    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    broker.register_node("n0", 1)
    job = broker.submit(JobSpec("t", "python train.py", total_steps=10))
    broker.ack(job.id, 1)
    broker.finish(job.id)
    model = Asset("file:///models/t")
    op = Mine(task_id="train", command="python train.py", total_steps=10, outlets=[model])
    events = {model: SimpleNamespace(extra={})}
    op._result(broker.job(job.id), {"outlet_events": events})
    assert events[model].extra == {"model": "t-v2"}


def test_one_call_that_never_answers_does_not_stop_the_trigger_following_the_job(worker_env, monkeypatch):
    """A backend call stuck for ever (an API server that accepted the connection and never answers)
    was given up after ``POLL_TIMEOUT_S``, but every later poll was refused while it had not
    answered: without an execution_timeout the trigger never fired the job's end."""
    from airflow_elastic_gpu.backends.local import LocalBackend
    from airflow_elastic_gpu.triggers import training

    monkeypatch.setattr(training, "POLL_TIMEOUT_S", 0.3)
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("j", "python train.py", 1, 1, total_steps=10))
    broker.ack(job.id, 1)
    release, calls = threading.Event(), []

    def sync(self, view, *, env=None, context=None):
        calls.append(view.id)
        if len(calls) == 1:
            release.wait(60)  # the one stuck client

    monkeypatch.setattr(LocalBackend, "sync", sync)
    monkeypatch.setattr(LocalBackend, "problem", lambda self, view: None)
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.03)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None))

    async def follow():
        running = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(0.5)
        broker.finish(job.id)
        return await asyncio.wait_for(running, 20)

    try:
        event = asyncio.run(follow())
    finally:
        release.set()
    assert event.payload["status"] == "succeeded" and len(calls) >= 2


@pytest.mark.parametrize("error", ["backend", "database"])
def test_a_restarted_trigger_that_cannot_reattach_for_a_moment_hands_the_job_to_the_worker(worker_env, monkeypatch,
                                                                                          error):
    """``start_from_trigger``: the trigger submits again after a triggerer restart and reattaches.
    One failure there (a cluster API's 503, the database away past the reconnect deadline) fired an
    event without the job, or crashed ``run``: the try failed, and the job trained on, followed by
    nobody. Now the event names the job, and the worker follows it to its end."""
    from sqlalchemy.exc import OperationalError

    from airflow_elastic_gpu.backends.base import BackendError
    from airflow_elastic_gpu.backends.local import LocalBackend

    broker, backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 40", total_steps=40,
                                 virtual_gpus=1, poll_interval=0.2, start_from_trigger=True)
    kwargs, job_id = _started_from_trigger(op)
    wait_for(lambda: backend.is_running(job_id), 30, "the job to run")
    failure = (BackendError("the API server answered 503") if error == "backend"
               else OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    with monkeypatch.context() as m:
        m.setattr(LocalBackend, "is_running", lambda self, jid: (_ for _ in ()).throw(failure))
        event = asyncio.run(asyncio.wait_for(_made_again(kwargs).run().__anext__(), 30))  # the same try
    assert event.payload["job_id"] == job_id and event.payload["status"] == "error"
    result = op.execute_complete({"ti": _FakeTI()}, event.payload)
    assert result["job_id"] == job_id and result["final_step"] == 40
    assert broker.job(job_id).status is JobStatus.SUCCEEDED



def test_a_cancel_that_comes_as_a_poll_answers_is_not_lost(worker_env, monkeypatch):
    """The triggerer's cancel (a user marked the task failed) that came while a poll's answer was
    on its way was lost (``asyncio.wait_for`` on Python 3.11 returned the answer instead): the
    trigger polled on for ever, and ``make test`` hung once. Cancelled at each step of the answer's
    way through the event loop, the poll raises the cancel every time."""
    from airflow_elastic_gpu.triggers import training

    broker, _, _ = worker_env
    _, _, trigger = _deferred_on(broker, "cancelled-as-it-answers")

    def answered(call, name):  # the poll's thread has answered already
        done = concurrent.futures.Future()
        done.set_result(call())
        return done

    monkeypatch.setattr(training, "in_daemon_thread", answered)

    async def cancel_after(steps: int) -> bool:
        task = asyncio.ensure_future(trigger._within_poll_timeout(lambda: "answered"))
        for _ in range(steps):
            await asyncio.sleep(0)
        if task.done():
            return False  # answered before the cancel came: nothing to lose
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return True

    assert sum(asyncio.run(cancel_after(steps)) for steps in range(1, 8)) >= 3
