"""ElasticTrainingTrigger: waits in the triggerer for a training job to end, and keeps the pool rebalanced.

Every ``poll_interval`` seconds it runs one :meth:`JobWatcher.poll
<airflow_elastic_gpu.triggers.watcher.JobWatcher.poll>` in a thread (the broker and backend calls
block; the triggerer's event loop must not): the broker's leased periodic rebalance, the backend
kept in step with the broker, a job whose processes are gone failed, its new events (resizes
with their reasons) logged into the task log. It fires once the broker records a terminal state,
after the backend has cleaned up (a clean-up that fails
:data:`~airflow_elastic_gpu.triggers.watcher.CLEANUP_TRIES` polls is logged as an error, and the
end fired all the same). A poll that fails is retried with new clients; the task's deadline holds
while polls fail. The trigger holds no state beyond its serialized arguments: after a triggerer
restart it re-polls and picks up where the broker is. The broker's record of
the job's end is the truth, whatever happened to the processes.

Started without a job id (the operator's ``start_from_trigger=True``), it first submits and starts
the job it is given (:func:`~airflow_elastic_gpu.triggers.submit.submit_and_start`, in a thread, with
the task instance's key): a restarted triggerer submits again, which the broker answers with the
same job (the key is idempotent) and the backend reattaches to its running processes; a job that
ended meanwhile is answered too (the job records the task try that submitted it,
``JobSpec.attempt``), and the trigger fires its end rather than train it again. A job it
cannot submit (a bad command, a broker that refuses it) fires ``{"job_id": None, "status": "error",
"reason": ...}``, which fails the task with that reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from airflow_elastic_gpu.broker.types import BrokerError, JobView, NotFound, check_pool_name
from airflow_elastic_gpu.compat import AirflowFailException, BaseTrigger, TriggerEvent
from airflow_elastic_gpu.config import airflow_conf, default_work_dir
from airflow_elastic_gpu.triggers.orphans import check_orphans
from airflow_elastic_gpu.triggers.task_instance import attempt_of
from airflow_elastic_gpu.triggers.threads import in_daemon_thread
from airflow_elastic_gpu.triggers.watcher import CleanupFailed, JobWatcher

TRIGGER_CLASSPATH = "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger"
_T = TypeVar("_T")
TIMEOUT_REASON = "execution_timeout"
"""How the reason of a job cancelled at its task's deadline begins (a time-out: retried)."""
TIME_OUT_TRIES = 3
"""Failed polls past the task's deadline whose cancel failed too (the triggerer cannot reach the
broker) after which the trigger fires an error event: the worker cancels the job, the task fails
and is retried, as on a time-out (it stayed deferred for ever, Airflow not enforcing
``execution_timeout`` while deferred)."""
TIMEOUT_CANCEL = f"{TIMEOUT_REASON}: the task's time ran out while it was deferred; cancelled"
"""The reason of a job cancelled at its deferred task's deadline (by the trigger, or by the worker
when the triggerer could not reach the broker)."""
NOT_FOUND_GRACE_S = 300.0
"""How long a trigger whose broker has no such job reads the connection again at every poll before
it gives up (seconds): Airflow 3 reports a connection it cannot read for a moment (a secrets backend
or its API server away) as not defined, and the broker of the ``[elastic_gpu]`` section is used then."""
KILLED_REASON = "task killed"
"""How the reason of a job cancelled by its task's ``on_kill`` (the operator's or the trigger's)
begins: retried, since Airflow kills a task whose worker shuts down or a trigger that moved to another
triggerer too (a task a user marked failed is not retried: its state is set already)."""
TRIGGER_KILLED = f"{KILLED_REASON} while deferred (marked failed or success, or cleared)"
"""The reason of a job cancelled by the trigger's ``on_kill``."""
STARTED_TRIGGER_ENDED = (f"{KILLED_REASON} while deferred (marked failed or success, cleared, or past its "
                         "execution_timeout)")
"""The reason of a job a ``start_from_trigger`` trigger cancels when Airflow cancels it with the
user-action message: a user's action, or its trigger timeout (``on_kill`` does not follow then)."""
USER_ACTION_CANCEL = "__airflow_user_action__"
"""The message of the ``CancelledError`` that Airflow 3's triggerer sends a trigger whose task a
user acted on (marked it failed or success, cleared it), just before it calls ``on_kill``; and one
whose trigger timeout passed (a ``start_from_trigger`` task's execution_timeout), without
``on_kill``."""
POLL_TIMEOUT_S = 60.0
"""The longest a poll of the job is waited for (seconds; at least 10 poll intervals): one stuck on a
database lock or an API server that never answers is then taken for a failed poll, so that the
task's execution_timeout is still enforced while it is deferred (its thread is left behind)."""
MAX_UNANSWERED = 3
"""Calls of one kind past :data:`POLL_TIMEOUT_S` a trigger leaves running before it stops calling."""
STATE_QUERY_TIMEOUT_S = 10.0
"""How long a trigger waits for the triggerer's supervisor to say whether its task instance is
still deferred (a triggerer shutting down has stopped reading the answers)."""
ON_KILL_STATE_QUERY_TIMEOUT_S = 120.0
"""The same wait in ``on_kill``, whose answer "no answer" stops the job: a loaded triggerer's
supervisor may take longer than :data:`STATE_QUERY_TIMEOUT_S` to say that a trigger given to
another triggerer is still deferred. The wait goes on in a thread of its own after Airflow's
``on_kill`` time (30 s) is over; a triggerer that exits meanwhile stops nothing."""


class ClientSetupError(Exception):
    """The triggerer cannot make the broker or backend client of a trigger (its configuration: a
    malformed broker URL, a database driver it lacks, bad backend settings)."""


class ElasticTrainingTrigger(BaseTrigger):
    """Fires ``{"job_id", "status", "reason"}`` when job ``job_id`` ends; ``status`` ``"error"``
    when it cannot be followed (the broker has no such job: the triggerer's broker is another
    than the task's) or, with ``job_id=None``, cannot be submitted (``job_id`` then ``None``).

    :param job_id: the broker's job id; ``None``: submit the job described by ``command``,
        ``checkpoint_dir``, ``job_name`` and ``job`` first (``start_from_trigger``).
    :param broker_conn_id: Airflow connection of the broker (see ``GpuBrokerHook``).
    :param poll_interval: seconds between polls.
    :param backend: the job's backend name (see :func:`~airflow_elastic_gpu.backends.make_backend`).
    :param work_dir: the local backend's job directory parent (default: the triggerer's).
    :param after_event_id: events up to this id were already logged.
    :param kubernetes: the Kubernetes backend's settings (``backend_settings``' result).
    :param env: the trainer's extra environment (to re-create its processes).
    :param context: the task's ``dag_id``, ``task_id``, ``run_id``, ``map_index`` (labels of
        re-created resources); default the trigger's task instance's.
    :param command: the training command to submit (rendered in the triggerer).
    :param checkpoint_dir: its checkpoint directory (rendered in the triggerer).
    :param job_name: its name in the broker (default the task id, with ``[map_index]``).
    :param deadline_s: when the task's ``execution_timeout`` runs out (Unix time, seconds; None:
        no timeout), which Airflow does not enforce while a task is deferred: past it the trigger
        cancels the job, stops its processes and fires its end (the task fails, and is retried as on
        Airflow's own timeout). A deadline, not a duration from the trigger's start, which a
        triggerer restart would move. (A ``start_from_trigger`` task's timeout is Airflow's trigger
        timeout: Airflow cancels :meth:`run`, which stops the job once the task is no longer
        deferred.)
    :param job: the other job fields to submit: ``total_steps``, ``min_gpus``, ``max_gpus``,
        ``requested_gpus``, ``progress_pattern``, ``gpu_pool`` (``None``: the connection's
        default), ``priority``, ``preemptible``, ``virtual_gpus``, ``virtual_nodes``, ``relative_speed``,
        ``broker_api_url_given``.
    """

    def __init__(self, job_id: str | None, broker_conn_id: str = "elastic_gpu_default",
                 poll_interval: float = 5.0, backend: str = "local", work_dir: str | None = None,
                 after_event_id: int = 0, kubernetes: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, context: dict[str, str] | None = None,
                 command: str | None = None, checkpoint_dir: str | None = None, job_name: str | None = None,
                 job: dict[str, Any] | None = None, deadline_s: float | None = None) -> None:
        super().__init__()
        self.job_id = job_id
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.backend = backend
        self.work_dir = work_dir
        self.after_event_id = after_event_id
        self.kubernetes = kubernetes
        self.env = env
        self.context = context
        self.command = command
        self.checkpoint_dir = checkpoint_dir
        self.job_name = job_name
        self.job = job
        self.deadline_s = deadline_s
        self._watcher: JobWatcher | None = None
        self._dropped: JobWatcher | None = None  # the watcher before the last failed poll
        self._submit_future: concurrent.futures.Future[JobView] | None = None
        self._submitted_id: str | None = None  # the job the broker has for this try, once it answered
        self._stopped = False  # the job was stopped when Airflow cancelled the trigger (on_kill skips)
        self._stop_lock = threading.Lock()
        self._unanswered: dict[str, list[concurrent.futures.Future[Any]]] = {}  # past POLL_TIMEOUT_S, by name

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "job_id": self.job_id, "broker_conn_id": self.broker_conn_id, "poll_interval": self.poll_interval,
            "backend": self.backend, "work_dir": self.work_dir, "after_event_id": self.after_event_id,
            "kubernetes": self.kubernetes, "env": self.env, "context": self.context,
            "deadline_s": self.deadline_s}
        if self.job is not None:
            kwargs.update(command=self.command, checkpoint_dir=self.checkpoint_dir, job_name=self.job_name,
                          job=self.job)
        return TRIGGER_CLASSPATH, kwargs

    def _submit(self) -> JobView:
        """Submit and start the job this trigger was given (``start_from_trigger``); blocking.

        :raises BrokerError | BackendError: the job cannot be submitted or started.
        :raises ValueError: the trigger has no task instance or no job to submit.
        """
        from airflow_elastic_gpu.backends import make_backend
        from airflow_elastic_gpu.hooks.broker import GpuBrokerHook
        from airflow_elastic_gpu.triggers.submit import submit_and_start, trigger_spec

        ti = self.task_instance
        if ti is None or self.job is None or self.command is None:
            raise ValueError("a trigger without job_id needs its task instance and the job to submit")
        if self.context is None:
            self.context = {"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
                            "map_index": str(ti.map_index)}
        job = self.job
        hook = GpuBrokerHook(self.broker_conn_id)
        if self.work_dir is None:
            self.work_dir = str(default_work_dir(conf=airflow_conf()))
        if self.kubernetes is not None and not job.get("broker_api_url_given"):
            url = hook.broker_api_url()
            if url:
                self.kubernetes = {**self.kubernetes, "broker_api_url": url}
        backend = make_backend(self.backend, broker=hook.broker, work_dir=self.work_dir,
                               kubernetes=self.kubernetes, virtual_gpus=job.get("virtual_gpus"),
                               virtual_nodes=int(job.get("virtual_nodes") or 1))
        if not (pool := job.get("gpu_pool")):  # the connection's: mended there, a retry takes it (retried)
            check_pool_name("the connection's pool", pool := hook.default_pool())
        try:  # the rendered arguments (a relative checkpoint_dir): a retry renders the same, so it is not retried
            spec = trigger_spec(ti, job, command=self.command, checkpoint_dir=self.checkpoint_dir,
                                job_name=self.job_name, backend=self.backend, pool=pool)
        except BrokerError as exc:
            raise AirflowFailException(str(exc)) from None
        return submit_and_start(hook.broker, backend, spec, env=self.env, labels=self.context, log=self.log,
                                on_submitted=lambda submitted: setattr(self, "_submitted_id", submitted.id)).job

    def _submitting(self) -> concurrent.futures.Future[JobView]:
        """:meth:`_submit` in a thread of its own; its future outlives a cancelled :meth:`run`, so
        that :meth:`on_kill` can wait for a submission under way and stop the job it started."""
        self._submit_future = in_daemon_thread(self._submit, "elastic-gpu-submit")
        return self._submit_future

    def _get_watcher(self) -> JobWatcher:
        """The watcher, with a new hook (broker client) and backend after :meth:`_drop_watcher`.
        Blocking (reads the Airflow connection): call it in a thread.

        :raises ClientSetupError: the triggerer cannot make them (no retry changes that).
        :raises NotFound: no broker is configured (:class:`.NoBrokerConfigured`): polled again for a while."""
        if self._watcher is None:
            from airflow_elastic_gpu.backends import BackendError, make_backend
            from airflow_elastic_gpu.hooks.broker import GpuBrokerHook, NoBrokerConfigured

            try:
                broker = GpuBrokerHook(self.broker_conn_id).broker
                backend = make_backend(self.backend, broker=broker, work_dir=self.work_dir,
                                       kubernetes=self.kubernetes)
            except NoBrokerConfigured as exc:  # also a connection unread for a moment: read again a while
                raise NotFound(f"job {self.job_id} has no broker to be read in: {exc}") from exc
            except (ValueError, ImportError, BackendError) as exc:  # a bad URL, a missing driver, bad settings
                raise ClientSetupError(f"the triggerer cannot make its broker or backend client: {exc}") from exc
            self._watcher = (JobWatcher(broker, backend, self.job_id, after_event_id=self.after_event_id,
                                        env=self.env, context=self.context, log=self.log)
                             if self._dropped is None else self._dropped.renewed(broker, backend))
        return self._watcher

    def _drop_watcher(self) -> None:
        """Forget the clients after an error, so the next poll makes new ones (the connection read
        again: changed credentials; a new backend client). The broker's engine, shared by every
        client of its URL in this process (every trigger of the triggerer), is left as it is: a
        connection the server dropped is invalidated and replaced by the broker itself."""
        if self._watcher is not None:
            self.after_event_id = self._watcher.after_event_id
            self._dropped, self._watcher = self._watcher, None  # renewed where it left off

    def _poll(self) -> JobView:
        watcher = self._get_watcher()
        job, _events = watcher.poll()
        self.after_event_id = watcher.after_event_id
        check_orphans(watcher.broker, watcher.backend, job.pool)  # jobs whose tasks ended unseen
        return job

    async def run(self) -> AsyncIterator[TriggerEvent]:
        fired = False
        try:
            async for event in self._events():
                fired = True
                yield event
        except asyncio.CancelledError as exc:
            # Airflow ended the deferral: a user's action (on_kill follows), or, without on_kill, a
            # start_from_trigger task's execution_timeout (a trigger timeout), with the user-action
            # message too. Once the task instance is no longer deferred nobody watches the job, so
            # it is stopped (and on_kill has nothing left to do). A triggerer that shuts down, or
            # gives the trigger to another, leaves the task deferred (or cannot tell): the job goes on
            if not fired:
                user_action = bool(exc.args) and exc.args[0] == USER_ACTION_CANCEL
                reason = ("the task's deferral ended without the job (timed out)" if not user_action
                          else TRIGGER_KILLED if self.command is None else STARTED_TRIGGER_ENDED)
                try:
                    await self._stop_unless_deferred(reason, unsure=True)
                except Exception as stop_exc:  # noqa: BLE001 - the cancel goes on (on_kill may try again)
                    self.log.warning("job %s: could not stop it (%s)", self.job_id, stop_exc)
            raise

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        if self.job_id is None:
            try:
                self.job_id = (await asyncio.wrap_future(self._submitting())).id
            except Exception as exc:  # noqa: BLE001 - every failure fires (a raise left the job unfollowed)
                self.log.error("could not submit the training: %s", exc)
                if isinstance(exc, AirflowFailException) or self._submitted_id is None:  # a bad setting: no retry
                    yield TriggerEvent({"job_id": None, "status": "error", "reason": str(exc),
                                        "retry": not isinstance(exc, AirflowFailException)})
                    return
                # the broker has the job (a re-submission after a restart meeting a cluster API or a
                # database away for a moment; a start that failed it): the worker follows it to its end
                yield TriggerEvent({"job_id": self._submitted_id, "status": "error", "deadline_s": self.deadline_s,
                                    "reason": f"could not start or reattach to the job: {exc}"})
                return
        timed_out, failures = False, 0  # failures: time-outs tried past the deadline that failed
        missing_since: float | None = None  # when the triggerer's broker first had no such job
        while True:
            try:
                job = await self._within_poll_timeout(self._poll)
                missing_since = None
                if not job.status.terminal and self._past_deadline():
                    if await self._within_poll_timeout(self._time_out):
                        continue  # the next poll reads the cancelled job and fires its end
                    self.deadline_s = None  # another try of the task follows the job: not this one's to end
            except NotFound as exc:  # this triggerer's broker is not the worker's, for a moment or for good
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since < NOT_FOUND_GRACE_S:
                    self.log.warning("%s in the triggerer's broker; reading the connection again in %ss (one "
                                     "that cannot be read is taken for not defined)", exc, self.poll_interval)
                    await asyncio.to_thread(self._drop_watcher)
                    await asyncio.sleep(self.poll_interval)
                    continue
                reason = (f"{exc} in the triggerer's broker for {NOT_FOUND_GRACE_S:.0f}s: the triggerer must reach "
                          f"the broker the task submitted to (connection {self.broker_conn_id!r} or "
                          "[elastic_gpu] broker_url)")
                self.log.error("%s", reason)
                yield TriggerEvent({"job_id": self.job_id, "status": "error", "reason": reason,
                                    "deadline_s": self.deadline_s})
                return
            except ClientSetupError as exc:  # a triggerer's configuration: polling again changes nothing
                self.log.error("job %s: %s", self.job_id, exc)
                yield TriggerEvent({"job_id": self.job_id, "status": "error", "reason": str(exc),
                                    "deadline_s": self.deadline_s})
                return
            except CleanupFailed as exc:  # the job has ended: its end is fired after a few tries
                if self._get_watcher().cleanup_failed(exc):
                    job = exc.job
                else:
                    await asyncio.sleep(self.poll_interval)
                    continue
            except Exception as exc:  # noqa: BLE001 - the broker DB or the cluster API is briefly unreachable
                self.log.warning("polling job %s failed (%s); retrying in %ss with new clients", self.job_id,
                                 exc, self.poll_interval)
                await asyncio.to_thread(self._drop_watcher)
                if self._past_deadline() and not timed_out:  # not put off by polls that keep failing
                    try:
                        timed_out = await self._within_poll_timeout(self._try_time_out)
                    except TimeoutError:  # stuck as the poll was: counted as a failed try
                        timed_out = False
                    if not timed_out and (failures := failures + 1) >= TIME_OUT_TRIES:
                        # the broker stays out of reach: the worker, whose broker it is, ends the job
                        reason = (f"{TIMEOUT_REASON}: the task's time ran out and the triggerer could not "
                                  f"cancel the job {TIME_OUT_TRIES} times ({exc})")
                        self.log.error("job %s: %s", self.job_id, reason)
                        yield TriggerEvent({"job_id": self.job_id, "status": "error", "reason": reason,
                                            "timed_out": True})
                        return
                await asyncio.sleep(self.poll_interval)
                continue
            if job.status.terminal:
                yield TriggerEvent({"job_id": job.id, "status": job.status.value, "reason": job.reason})
                return
            await asyncio.sleep(self.poll_interval)

    def _past_deadline(self) -> bool:
        return self.deadline_s is not None and time.time() >= self.deadline_s

    async def _within_poll_timeout(self, call: Callable[[], _T]) -> _T:
        """``call()`` in a daemon thread, waited for :data:`POLL_TIMEOUT_S` (at least 10 poll
        intervals). A call past it is left to answer in its thread, and the next one (with the new
        clients a failed poll makes) goes ahead: one stuck client (an API server that accepted the
        connection and never answers) wedged the trigger, which then never fired the job's end. At
        most :data:`MAX_UNANSWERED` of a kind are left so (no pile of stuck threads, and none in the
        event loop's executor, which every trigger shares).

        :raises TimeoutError: no answer by then, or too many earlier calls still missing."""
        name, limit_s = getattr(call, "__name__", "call"), max(POLL_TIMEOUT_S, 10 * self.poll_interval)
        stuck = self._unanswered[name] = [f for f in self._unanswered.get(name, []) if not f.done()]
        if len(stuck) >= MAX_UNANSWERED:
            raise TimeoutError(f"{len(stuck)} earlier {name} calls have not answered yet (a database lock held, "
                               "or an API server that does not answer)")
        future = in_daemon_thread(call, f"elastic-gpu{name}")
        try:  # not wait_for: on Python 3.11 it lost a cancel that came as the call answered (the
            # triggerer's, when a user marks the task failed), and the trigger polled on for ever
            async with asyncio.timeout(limit_s):
                return await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            stuck.append(future)
            raise TimeoutError(f"no answer in {limit_s:.0f}s (a database lock held, or an API server that does "
                               "not answer)") from None

    def _try_time_out(self) -> bool:
        """:meth:`_time_out` after a failed poll (the job may have ended; the broker may be away:
        a failure is logged, and the next failed poll tries again).

        :returns: True once acted on (the job cancelled and its processes stopped, or left to the
            later try of the task that follows it)."""
        try:
            self._time_out()
        except Exception as exc:  # noqa: BLE001 - logged; the next failed poll tries again
            self.log.warning("could not time job %s out (%s); trying again after the next poll", self.job_id, exc)
            self._drop_watcher()
            return False
        return True

    def _time_out(self) -> bool:
        """Cancel the job past ``deadline_s`` and stop its processes (blocking).

        :returns: False when the job was left alone (another try of the task follows it)."""
        self.log.error("job %s: %s", self.job_id, TIMEOUT_CANCEL)
        return self._kill(TIMEOUT_CANCEL)

    def _kill(self, reason: str) -> bool:
        """Cancel the job (``reason``) and stop its processes (blocking; after a submission under
        way, once it is done).

        :returns: False when there was nothing to stop, or the job was left alone: a later try of
            the task reattached to it (a cleared task)."""
        if self.job_id is None and self._submit_future is not None:
            try:
                self.job_id = self._submit_future.result().id
            except Exception:  # noqa: BLE001 - the submission failed: no job was started
                return False
        if self.job_id is None:
            return False
        watcher = self._get_watcher()
        ti = self.task_instance
        job = watcher.broker.cancel(self.job_id, reason, attempt=None if ti is None else attempt_of(ti))
        if not job.status.terminal:  # a later try of the task reattached to it (a cleared task)
            self.log.info("job %s goes on: a later try of its task follows it now", self.job_id)
            return False
        watcher.backend.stop(self.job_id, timeout_s=30)
        return True

    def _still_deferred(self, unsure: bool = False, timeout_s: float | None = None) -> bool:
        """Whether this trigger's task instance is still deferred, asked through the triggerer's
        supervisor (blocking: call it in a thread).

        :param unsure: the answer when it cannot be told (no task instance, no supervisor to ask, or
            no answer within ``timeout_s``, default :data:`STATE_QUERY_TIMEOUT_S`: a triggerer shutting down no longer
            reads its supervisor's answers, and the question blocked for ever, holding up the
            shutdown until the supervisor's SIGKILL): ``False`` for ``on_kill`` (its documented
            meaning: a user acted), ``True`` for a cancelled :meth:`run` (a triggerer shutting
            down must never stop a job).
        """
        ti = self.task_instance
        if ti is None:
            return unsure
        wait_s = STATE_QUERY_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            return in_daemon_thread(lambda: RuntimeTaskInstance.get_ti_count(
                dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id], map_index=ti.map_index,
                states=["deferred"]), "elastic-gpu-ti-state").result(wait_s) > 0
        except TimeoutError:
            self.log.warning("the triggerer's supervisor did not say within %gs whether task instance %s is "
                             "still deferred (the triggerer stops?); taking it as %s", wait_s, ti,
                             "deferred" if unsure else "ended by a user")
            return unsure
        except (concurrent.futures.CancelledError, EOFError, ConnectionError) as exc:
            # the triggerer stops: it cancelled the questions waiting for the supervisor's answers,
            # or lost the supervisor; a trigger of a triggerer that stops never stops its job
            self.log.info("the question whether task instance %s is still deferred ended with the triggerer "
                          "(%s); taking it as deferred", ti, type(exc).__name__)
            return True
        except Exception as exc:  # noqa: BLE001 - no supervisor to ask (a test, an older Airflow)
            self.log.warning("could not read the state of task instance %s (%s); taking it as %s", ti, exc,
                             "deferred" if unsure else "ended by a user")
            return unsure

    async def _stop_unless_deferred(self, reason: str, unsure: bool, timeout_s: float | None = None) -> None:
        """Cancel the job and stop its processes unless the task instance is still deferred (one
        thread for the check, the wait for a submission under way and the stop: it goes on if the
        caller is cancelled); nothing to do before a submission started."""
        if (self.job_id is None and self._submit_future is None) or self._stopped:
            return

        def stop() -> None:
            # one stop at a time: Airflow cancels the trigger again about every second, so on_kill
            # may come while run()'s stop still waits for its answer (in its own thread)
            with self._stop_lock:
                if self._stopped:
                    return
                try:
                    if self._still_deferred(unsure, timeout_s):
                        self.log.info("job %s goes on: its task instance is still deferred (the trigger moved "
                                      "to another triggerer, or the triggerer stops)", self.job_id or "being submitted")
                        return
                    self._kill(reason)
                except Exception as exc:  # nobody may wait for this thread any more: say so
                    self.log.warning("job %s: could not stop it (%s)", self.job_id or "being submitted", exc)
                    raise
                self._stopped = True  # on_kill, which may follow, has nothing left to do

        # a thread of its own: the triggerer's default executor may be busy with other triggers'
        # polls, and a stop queued there is dropped when on_kill's time (30 s) runs out
        await asyncio.wrap_future(in_daemon_thread(stop, "elastic-gpu-stop"))

    async def on_kill(self) -> None:
        """The user marked the deferred task failed/success or cleared it: stop the job, free its GPUs
        (a ``start_from_trigger`` trigger killed while it submits waits for the submission, then
        stops the job it started).

        Airflow 3.3 also calls ``on_kill`` on a live triggerer whose trigger was given to another
        one (its heartbeat was late, e.g. on a loaded machine): the task instance is then still
        deferred, the other triggerer watches the job, and the job goes on. The question may wait
        :data:`ON_KILL_STATE_QUERY_TIMEOUT_S` for the answer (past Airflow's 30 s for ``on_kill``,
        in a thread of its own) before it takes no answer for a user's action."""
        await self._stop_unless_deferred(TRIGGER_KILLED, unsure=False,
                                         timeout_s=ON_KILL_STATE_QUERY_TIMEOUT_S)
