"""Agent: the sidecar that relays between the broker and the launcher's shared directory.

Every ``poll_s`` seconds it heartbeats the broker (which returns the job's
target generation), records the confirmed contact in ``lease.json`` (the
launcher fences the trainer when it grows stale, see ``docs/fencing.md``),
writes a newer target to ``desired.json``, parses new log lines into progress
samples, acks a generation once ``status.json`` shows the trainer running on
it, and reports the trainer's final exit (``finish`` with the metrics line, or
``fail`` with the last log lines). If the broker says the job is cancelled or
lost, it tells the launcher to stop.

In a pod that runs one generation only (``--pod-generation``, the Kubernetes backend's
``resize_mechanism="recreate"``) a newer target is not applied in place: the backend replaces the
pod, and the launcher's stop that comes with the pod's deletion is not a failure. SIGTERM (the pod
is being deleted) ends the agent at its next poll, after reporting a trainer exit it has seen; as a
container's first process it would otherwise ignore the signal and hold the pod's deletion for its
whole grace period.

The agent never dies of a broker answer: each call's error is classified by
:func:`classify`: a rejected report is dropped with a log line, a transient
failure retried on the next poll, and "the job ended or is unknown" stops the
trainer.

Progress lines: by default JSON objects with a ``"step"`` key (a JSON object
with ``"final": true`` is kept as the job's metrics); or any line matching
``progress_pattern`` (group ``step``, or its only group).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.calls import BrokerTransport, Outcome, classify
from airflow_elastic_gpu.sidecar.ends import EndReports
from airflow_elastic_gpu.sidecar.gang import Gang, node_dirs, node_part
from airflow_elastic_gpu.sidecar.logparse import LogParser
from airflow_elastic_gpu.states import Target

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_LEASE_S = 60.0
"""A new pool's lease in the broker; used when neither the broker's answer nor ``--lease-s`` gives one."""



class Agent(EndReports):
    """Relays one job between ``broker`` and ``shared_dir`` until the job ends.

    :param launcher_pid: the local launcher's pid (a gang job: its launchers' pids); if one dies
        without an exit status the job fails (in Kubernetes the pod status plays this part). Given,
        it also means the launcher shares this process's pid namespace: the agent's pid goes into
        ``lease.json`` so the launcher can tell when the agent is gone.

    A ``shared_dir`` with a ``nodes/`` directory is a gang job (:mod:`.gang`): one launcher per
    node, resized together, acked once every node runs the generation.
    :param lease_s: the broker's lease of the job's pool (seconds); a ``lease_s`` in the
        heartbeat answer, where the broker gives one, wins.
    :param fence_s: no confirmed contact for this long and the launcher stops the trainer
        (seconds; default ``lease_s / 2``, see :func:`~airflow_elastic_gpu.sidecar.protocol.fence_periods`).
    :param fence_margin_s: every process of the trainer is dead this long before the lease ends
        (seconds; default ``max(1, lease_s / 10)``).
    :param end_report_timeout_s: how long to retry reporting the trainer's exit through broker
        outages (seconds).
    :param clock: wall clock (epoch seconds) for ``lease.json``; the launcher reads the same clock.
    :param pod_generation: the one generation this agent's pod runs (a pod re-created per
        generation); ``None``: every new generation is applied in place.
    :param host_node: the node this agent's pod runs on (one pod per job): a generation with GPUs on
        another node is not applied here (device indices name other GPUs on each node); the
        backend replaces the pod.
    :param node, gang_domain, rendezvous_port: a gang with one agent per node (a pod per node):
        this agent's node, runs its part (:func:`~.gang.node_part`: the rank-0 node's pod in
        ``gang_domain`` at ``rendezvous_port``) and acks that node only; a trainer ending with 0
        without final metrics (not the global rank 0) reports its node's clean exit and waits for
        the job's end (the broker ends it when the metrics come or every node has exited).
    :raises ValueError: fence periods that do not fit in the lease.
    """

    def __init__(
        self,
        broker: BrokerTransport,
        job_id: str,
        shared_dir: Path,
        *,
        progress_pattern: str | None = None,
        poll_s: float = 1.0,
        stop_timeout_s: float = 60.0,
        launcher_pid: int | list[int] | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        fence_s: float | None = None,
        fence_margin_s: float | None = None,
        end_report_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        pod_generation: int | None = None,
        host_node: str | None = None,
        node: str | None = None,
        gang_domain: str = "",
        rendezvous_port: int = 29500,
    ) -> None:
        self.broker = broker
        self.job_id = job_id
        self.dir = shared_dir
        pattern = re.compile(progress_pattern) if progress_pattern else None
        self.parser = LogParser(pattern)
        dirs = node_dirs(shared_dir)
        self.gang = Gang(dirs) if dirs else None
        self.parsers = {node: LogParser(pattern) for node in dirs}  # a gang's: one per node's log
        self.written = 0  # the last generation written for the launcher(s)
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        pids = [launcher_pid] if isinstance(launcher_pid, int) else list(launcher_pid or [])
        self.launcher_pids = pids
        # their start times, so that a pid another process took since is never signalled
        self.launcher_starts = {p: st[1] for p in pids if (st := protocol.proc_stat(p)) is not None}
        self.launcher_pid = pids[0] if pids else None
        self.fence_s = fence_s
        self.fence_margin_s = fence_margin_s
        self.periods = protocol.fence_periods(lease_s, fence_s, fence_margin_s)
        self.end_report_timeout_s = end_report_timeout_s
        self.clock = clock
        self.pending: dict[int, float] = {}  # generation -> latest step not reported yet
        self.pod_generation = pod_generation
        self.host_node, self.moved_away = host_node, False
        self.dropped = False  # a gang's pod: the newest generation runs on other nodes only
        self.clean_nodes: set[str] = set()  # a gang on this host: nodes whose clean exit was reported
        self.unapplied = 0  # a finishing gang: the newest generation it did not apply (logged once)
        self.node, self.gang_domain, self.rendezvous_port = node, gang_domain, rendezvous_port
        self.newest_generation = 0  # the newest target generation the broker has answered
        self.ended: int | None = None  # run()'s result once the job's end was dealt with while applying a target
        self.terminating = threading.Event()
        if poll_s * 3 > self.periods.fence_s:
            log.warning("poll period %gs is long for a fence of %gs: the trainer may be fenced between two "
                        "heartbeats", poll_s, self.periods.fence_s)

    def _desired(self) -> dict[str, Any]:
        return protocol.read_json(self.dir / protocol.DESIRED) or {}

    def _status(self) -> dict[str, Any]:
        if self.gang is not None:
            return self.gang.status(self.written)
        return protocol.read_json(self.dir / protocol.STATUS) or {}

    def _launcher_gone(self) -> int | None:
        """The pid of a launcher that is no longer alive without having reported its trainer's exit,
        if any (a gang's node whose trainer exited before the others' is not gone: the job ends once
        every node's has)."""
        exited = {s.get("launcher_pid") for s in self._launcher_statuses() if s.get("state") == protocol.EXITED}
        # the launcher, not a process that took its pid since (an OOM kill, then a reused pid)
        return next((p for p in self.launcher_pids
                     if not protocol.same_process(p, self.launcher_starts.get(p)) and p not in exited), None)

    def terminate(self) -> None:
        """End :meth:`run` at its next poll (SIGTERM); a trainer exit already written is still reported."""
        self.terminating.set()

    def _replaced(self) -> bool:
        """True when this pod runs one generation and the broker has moved past it, the job moved
        to another node (the pod is being replaced), or the gang's newest generation left this
        pod's node out (the pod is deleted once every node has acked it)."""
        return self.moved_away or self.dropped or (
            self.pod_generation is not None and self.newest_generation > self.pod_generation)

    def run(self) -> int:
        """Relay until the job ends; 0 when the job's end was reported to the broker (or the broker
        had ended it), 1 when the end could not be reported or the launcher ended from outside."""
        written = self.written = int(self._desired().get("generation", 0))
        acked = 0
        for parser, d in self._logs():  # a restarted agent: skip the log already reported
            status = protocol.read_json(d / protocol.STATUS)
            if status is not None:
                parser.generation = int(status.get("generation", 0))
                parser.skip(d / protocol.LOG)
        unsure_since: float | None = None  # since when a stop or a failed exit awaits the broker's word
        while True:
            if self.terminating.is_set():
                status = self._status()
                if status.get("state") == protocol.EXITED:
                    if self._may_be_replaced() and self._ends_the_job(status):  # ask the broker once more
                        self._refresh()
                    return self._report_exit(protocol.exit_code(status))
                if self.node is not None:  # a gang's pod deleted after the job ended: report its node's stop
                    outcome, target = self._call("heartbeat", self.broker.heartbeat, self.job_id)
                    if outcome is Outcome.ENDED or (outcome is Outcome.OK and target.status.terminal):
                        return self._stop_ended("the pod is being deleted after the job ended")
                log.info("terminated (the pod is being deleted): the launcher stops the trainer")
                return 0
            sent_s = self.clock()  # before the call: the broker's record of this contact is later
            outcome, target = self._call("heartbeat", self.broker.heartbeat, self.job_id)
            if outcome is Outcome.ENDED:
                return self._stop_ended("the broker no longer knows the job as running")
            contact = outcome is Outcome.OK
            if contact:
                if target.status.terminal:
                    return self._stop_ended(f"job is {target.status.value} in the broker")
                if (back := self._went_back(target, written)) is not None:
                    log.error("%s: the trainer may run on GPUs the broker can hand to another job", back)
                    return self._stop_ended(back)
                self._renew(sent_s, target)
                self.newest_generation = max(self.newest_generation, target.generation)
                written = self.written = self._apply(target, written)
                if self.ended is not None:
                    return self.ended
            if self._report_progress(contact) is Outcome.ENDED:
                return self._stop_ended("the broker no longer knows the job as running")
            status = self._status()
            gen = int(status.get("generation", 0))
            if (contact and status.get("state") in (protocol.RUNNING, protocol.SUSPENDED) and gen > acked
                    and gen == target.generation):
                ack, _ = self._call(f"ack of generation {gen}", self._ack, gen)
                if ack is Outcome.ENDED:
                    return self._stop_ended("the broker no longer knows the job as running")
                if ack is not Outcome.TRANSIENT:  # a rejected ack is not retried
                    acked = gen
            if not contact and self._may_be_replaced() and self._ends_the_job(status):
                # judged on a poll whose heartbeat got through only: what _replaced() reads is the
                # broker's word of an earlier poll, and a pod being replaced (re-creation, a move, a
                # gang's dropped node) then read as stopped from outside, failing a job that moved on.
                # The report needs the broker too: past its time-out the lease ends the job
                unsure_since = unsure_since if unsure_since is not None else time.monotonic()
                if time.monotonic() - unsure_since >= self.end_report_timeout_s:
                    log.error("the launcher is %s and the broker stayed unreachable for %gs: the job's lease "
                              "will end it", status.get("state"), self.end_report_timeout_s)
                    return 1
                self.terminating.wait(self.poll_s)
                continue
            unsure_since = None
            if self._may_be_replaced() and self._ends_the_job(status):
                # this poll's heartbeat may predate the generation that replaces this pod (published,
                # and the pod deleted, while a progress or ack call waited on the rebalance's lock)
                if self.terminating.is_set():
                    continue  # the pod is being deleted: the loop's top deals with it
                self._refresh()
                if self.ended is not None:
                    return self.ended
            if status.get("state") == protocol.EXITED:
                return self._report_exit(protocol.exit_code(status))
            if self.gang is not None and contact and status.get("state") != protocol.STOPPED:
                self._report_clean_nodes()
            if status.get("state") == protocol.STOPPED:
                if self._replaced():
                    log.info("the launcher stopped: this pod is being replaced (%s)",
                             "the job moved to another node" if self.moved_away
                             else "the gang no longer uses this node" if self.dropped
                             else f"it runs generation {self.pod_generation} only")
                    return 0
                # a gang of launchers on this host: the others may still run their trainers
                if self.gang is None or self._stopped("a launcher of the gang was stopped from outside"):
                    self._report_end("fail", functools.partial(
                        self.broker.fail, self.job_id, "the launcher was stopped from outside the broker",
                        **self._node_kw))
                else:  # they did not stop: their GPUs must not be freed, the lease ends the job
                    log.error("the gang's other launchers did not stop: the broker's lease will end the job")
                return 1
            if (gone := self._launcher_gone()) is not None:
                time.sleep(self.poll_s)  # it may have written its last status just now
                status = self._status()
                if status.get("state") == protocol.EXITED:
                    return self._report_exit(protocol.exit_code(status))
                # no launcher to stop it: kill the orphaned trainer and its workers before the GPUs
                # are released, so nothing runs on GPUs the broker hands to another job (a gang:
                # every node's, and the other launchers are told to stop)
                if not self._orphans_killed() or (
                        self.gang is not None and not self._stopped("a launcher of the gang died")):
                    # a trainer still runs: its GPUs must not be freed, the lease ends the job
                    log.error("the dead launcher's trainer did not stop: the broker's lease will end the job")
                    return 1
                self._report_failure(f"the launcher (pid {gone}) died without reporting an exit; its trainer was killed")
                return 1
            self.terminating.wait(self.poll_s)

    def _went_back(self, target: Target, written: int) -> str | None:
        """Why the broker's record of the job is older than what the trainer was given (its database
        restored from a backup, or failed over to a replica that lost the latest commits), or None:
        its generation is below the one written, or the one written names other GPUs there. The
        broker then does not know the GPUs the trainer runs on and may hand them to another job, so
        the job is stopped and failed (its next try resumes from its checkpoint)."""
        if target.generation < written:
            return (f"the broker's generation went back from {written} to {target.generation} "
                    "(its database restored or failed over?)")
        desired = self._desired()
        if not written or target.generation != written or int(desired.get("generation", 0)) != written:
            return None
        mine = desired.get("gpus")
        theirs = self._part(target)["gpus"] if self.gang is None else [[g.node, g.index] for g in target.gpus]
        if mine is None or mine == theirs:  # both as JSON has them: indices, or [node, index] pairs
            return None
        return (f"the broker's generation {written} names other GPUs ({theirs}) than the trainer was given "
                f"({mine}): its database restored or failed over?")

    def _may_be_replaced(self) -> bool:
        """Whether the broker may replace this agent's pod (one of a generation, on a node, or a
        gang's node): else no heartbeat can tell it a stop or a failed exit is not the job's end."""
        return self.pod_generation is not None or self.host_node is not None or self.node is not None

    def _ends_the_job(self, status: dict[str, Any]) -> bool:
        """Whether the launcher's ``status`` would end the job (a stop from outside, a failed exit)
        unless this pod was replaced (:meth:`_replaced`)."""
        state = status.get("state")
        return (state == protocol.STOPPED or (state == protocol.EXITED and protocol.exit_code(status) != 0)) and (
            not self._replaced())

    def _refresh(self) -> None:
        """One heartbeat, whose target updates what :meth:`_replaced` reads (a pod being deleted:
        the last poll's heartbeat may have failed)."""
        outcome, target = self._call("heartbeat", self.broker.heartbeat, self.job_id)
        if outcome is Outcome.OK and not target.status.terminal:
            self.newest_generation = max(self.newest_generation, target.generation)
            self.written = self._apply(target, self.written)

    def _apply(self, target: Target, written: int) -> int:
        """Hand a running job's target to the launcher: a newer generation, or the permission to
        restart a fenced trainer on the generation the broker still runs; the generation written.
        A pod of one generation is given no other GPUs (a suspension, no GPUs, still applies)."""
        if self.pod_generation is not None and target.generation > self.pod_generation and target.gpus:
            if written <= self.pod_generation:
                log.info("generation %d: this pod (generation %d) waits to be replaced", target.generation,
                         self.pod_generation)
            return max(written, target.generation)
        if self.gang is not None:
            return self._apply_gang(target, written)
        if (self.host_node is not None and self.node is None and target.gpus
                and any(g.node != self.host_node for g in target.gpus)):
            if not self.moved_away:  # its device indices name GPUs of another node: never run them here
                log.info("generation %d is on another node: this pod (node %s) waits to be replaced",
                         target.generation, self.host_node)
            self.moved_away = True
            return max(written, target.generation)
        part = self._part(target)
        if self.node is not None and target.gpus and target.generation >= written:
            # the gang goes on without this node (read from the target each time: an agent
            # restarted after the generation that dropped its node was written knows it too)
            self.dropped = not part["gpus"]
        if target.generation > written and (target.gpus or written > 0):
            # a generation with no GPUs after one with GPUs: the job is suspended (the launcher
            # stops the trainer, letting it checkpoint, and waits; the ack then frees its GPUs); a
            # node of a gang that the generation does not use is suspended the same way
            protocol.write_json(self.dir / protocol.DESIRED, {"generation": target.generation, **part, "stop": False})
            log.info("generation %d -> GPUs %s", target.generation, part["gpus"] or "none (suspended)")
            return target.generation
        status = self._status()
        fences = int(status.get("fences") or 0)
        desired = self._desired()
        if (status.get("state") == protocol.FENCED and int(status.get("generation", 0)) == target.generation
                and part["gpus"] and int(desired.get("resume", 0)) < fences):
            protocol.write_json(self.dir / protocol.DESIRED,
                                {"generation": target.generation, **part, "stop": False, "resume": fences})
            log.info("the broker still runs generation %d: the fenced trainer may restart", target.generation)
        return written

    def _part(self, target: Target) -> dict[str, Any]:
        """What ``desired.json`` says of ``target`` besides its generation: the GPUs (device
        indices), and for a node of a gang with one agent per node its shape and rendezvous."""
        if self.node is None:
            return {"gpus": target.device_indices()}
        pairs = [(g.node, g.index) for g in target.gpus]
        return node_part(pairs, self.node, self.gang_domain, self.rendezvous_port)

    def _ack(self, generation: int) -> bool:
        return self.broker.ack(self.job_id, generation, **self._node_kw)

    def _apply_gang(self, target: Target, written: int) -> int:
        """:meth:`_apply` for a gang: a newer generation goes to every node at once (a gang resize)."""
        assert self.gang is not None
        if target.generation > written and (finished := self._finished_nodes()):
            # the gang is finishing: a new generation would stop the trainers still running (rank
            # 0 may be evaluating) and never run on the finished nodes; the broker keeps the
            # allocation fixed once it has their reports, and frees the GPUs at the job's end
            if target.generation > self.unapplied:
                log.info("generation %d not applied: the trainer on %s exited cleanly, the gang is finishing",
                         target.generation, ", ".join(finished))
                self.unapplied = target.generation
            # the generation it runs keeps its GPUs until the newer one is acked (never, now): a
            # trainer fenced on it (rank 0 evaluating) may restart, the broker still runs the job.
            # One that needs its finished peers' rendezvous then fails, and the job with it,
            # rather than staying fenced for good with the gang's GPUs held
            self._resume_fenced(written)
            return written
        if target.generation > written and (target.gpus or written > 0):  # no GPUs after some: suspended
            pairs = [(g.node, g.index) for g in target.gpus]
            try:
                plan = self.gang.publish(target.generation, pairs)
            except ValueError as exc:  # not runnable here: fail the job rather than run half of it
                log.error("%s", exc)
                # the fail frees the job's GPUs: every node's trainer stops first, as at any gang's end
                if self._stopped(str(exc)):
                    self.ended = self._report_end("fail", functools.partial(self.broker.fail, self.job_id, str(exc)))
                else:
                    log.error("the gang's launchers did not stop: the broker's lease will end the job")
                    self.ended = 1
                return written
            protocol.write_json(self.dir / protocol.DESIRED, {"generation": target.generation, "gpus": pairs,
                                                              "stop": False})
            log.info("generation %d -> %s", target.generation,
                     ", ".join(f"{n} (rank {p['node_rank']}): GPUs {p['gpus']}" for n, p in plan.items())
                     or "no GPUs (suspended on every node)")
            return target.generation
        if target.gpus:
            self._resume_fenced(target.generation)
        return written

    def _resume_fenced(self, generation: int) -> None:
        """Let each node of a gang whose trainer was fenced on ``generation`` (a generation the
        broker still runs the job on, with GPUs on that node) restart it, once per fence."""
        assert self.gang is not None
        for node, status in self.gang.statuses().items():
            fences = int(status.get("fences") or 0)
            desired = self.gang.desired(node)
            if (status.get("state") == protocol.FENCED and int(status.get("generation", 0)) == generation
                    and desired.get("gpus") and int(desired.get("resume", 0)) < fences):
                self.gang.resume(node, fences)
                log.info("the broker still runs generation %d: node %s's fenced trainer may restart",
                         generation, node)

    def _logs(self) -> list[tuple[LogParser, Path]]:
        """Each log the agent parses, with its launcher directory."""
        if self.gang is None:
            return [(self.parser, self.dir)]
        return [(self.parsers[node], d) for node, d in self.gang.dirs.items()]

    def _renew(self, sent_s: float, target: Target) -> None:
        """Record a confirmed contact (sent at ``sent_s``) in ``lease.json`` for the launcher."""
        lease_s = getattr(target, "lease_s", None) or self.periods.lease_s  # the broker's own, where it says
        if lease_s != self.periods.lease_s:
            try:
                self.periods = protocol.fence_periods(lease_s, self.fence_s, self.fence_margin_s)
            except ValueError as exc:  # configured periods too long for the broker's lease: its defaults
                log.warning("%s; using the default fence periods for a %gs lease", exc, lease_s)
                self.periods = protocol.fence_periods(lease_s)
            log.info("broker lease %gs: fence after %gs, kill by %gs", lease_s, self.periods.fence_s,
                     self.periods.kill_s)
        lease = {
            "contact_s": sent_s, "lease_s": self.periods.lease_s, "fence_s": self.periods.fence_s,
            "kill_s": self.periods.kill_s, "generation": target.generation, "status": target.status.value,
            "agent_pid": os.getpid() if self.launcher_pid is not None else None,
        }
        if self.node is not None:  # a gang of pods: another pod's agent may see a generation up to
            # a poll and three requests (heartbeat, progress, ack) later than this one, plus a poll
            lease["peer_wait_s"] = 2 * self.poll_s + 3 * float(getattr(self.broker, "timeout_s", 0.0) or 0.0)
        if self.gang is not None:
            self.gang.write_all(protocol.LEASE, lease)
        protocol.write_json(self.dir / protocol.LEASE, lease)

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[Outcome, T | None]:
        """Call the broker; an error is classified (:func:`classify`) and logged, never raised."""
        try:
            return Outcome.OK, fn(*args, **kwargs)
        except Exception as exc:  # the agent must outlive any answer: classified, logged, never raised
            outcome = classify(exc)
            if outcome is Outcome.ENDED:
                log.warning("%s: the job ended or is unknown to the broker: %s", what, exc)
            elif outcome is Outcome.REJECTED:
                log.warning("%s rejected by the broker, dropped: %s", what, exc)
            else:
                known = type(exc).__module__.split(".")[0] == "sqlalchemy" or isinstance(exc, OSError) or (
                    type(exc).__name__ == "BrokerUnavailable")
                log.warning("%s failed, will retry: %s: %s", what, type(exc).__name__, exc, exc_info=not known)
            return outcome, None

    def _report_progress(self, contact: bool, *, to_end: bool = False) -> Outcome | None:
        """Parse new log lines (``to_end``: all of them, for a trainer that has exited; else at most
        one read's worth); with ``contact``, report the latest step of each generation. A rejected
        sample is dropped, a transient failure kept for the next poll; ``ENDED`` if the broker no
        longer knows the job."""
        # a gang: every node's log is read, as the trainer's global rank 0 prints the progress, and a
        # rendezvous (torchrun's c10d) may put it on any node of the gang
        logs = [(self.parser, self.dir)] if self.gang is None else [(self.parsers[n], d) for n, d in self.gang.dirs.items()]
        for parser, d in logs:
            for gen, step in (parser.read_all if to_end else parser.read)(d / protocol.LOG):
                self.pending[gen] = step
        if not contact:
            return None
        for gen, step in sorted(self.pending.items()):
            outcome, _ = self._call(f"progress (step {step!r}, generation {gen})", self.broker.progress,
                                    self.job_id, step, generation=gen or None)
            if outcome is Outcome.TRANSIENT:
                return outcome
            del self.pending[gen]
            if outcome is Outcome.ENDED:
                return outcome
        return None

if __name__ == "__main__":  # python -m airflow_elastic_gpu.sidecar.agent (how the backends start it)
    from airflow_elastic_gpu.sidecar.agent_cli import main

    sys.exit(main())
