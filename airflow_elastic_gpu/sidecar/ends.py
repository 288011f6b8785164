"""The agent's end of a job: its trainer's exit reported to the broker (``finish`` with the metrics
line, ``fail`` with the last log lines), the trainer stopped when the broker ended the job, and,
for a gang of pods (one agent per node), every report naming its node so that the broker frees
that node's GPUs only (``docs/fencing.md``)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_elastic_gpu.sidecar import protocol, stops
from airflow_elastic_gpu.sidecar.calls import BrokerTransport, Outcome
from airflow_elastic_gpu.sidecar.gang import Gang
from airflow_elastic_gpu.sidecar.logparse import LogParser, log_excerpt
from airflow_elastic_gpu.sidecar.marks import marked_processes

log = logging.getLogger("airflow_elastic_gpu.sidecar.agent")
FROZEN_LAUNCHER_S = 2.0
"""How long a stop waits for a launcher in the stopped state (``T``: SIGSTOP, ``t``: a debugger)
before it SIGKILLs it: its trainer is then killed as a dead launcher's is."""


class EndReports:
    """The end-of-job half of :class:`~airflow_elastic_gpu.sidecar.agent.Agent` (a mixin: the
    attributes below are the agent's, and so are ``_call``, ``_status`` and ``_report_progress``)."""

    broker: BrokerTransport
    job_id: str
    dir: Path
    node: str | None
    gang: Gang | None
    parser: LogParser
    parsers: dict[str, LogParser]
    written: int
    clean_nodes: set[str]
    poll_s: float
    stop_timeout_s: float
    end_report_timeout_s: float
    launcher_pids: list[int]
    launcher_starts: dict[int, int]
    terminating: threading.Event
    _call: Callable[..., tuple[Outcome, Any]]
    _status: Callable[[], dict[str, Any]]
    _report_progress: Callable[..., Outcome | None]
    _replaced: Callable[[], bool]

    @property
    def _node_kw(self) -> dict[str, str]:
        """The ``node`` argument of this agent's end reports: a gang of pods reports its own node
        (the broker frees that node's GPUs only), one agent for the whole job none."""
        return {} if self.node is None else {"node": self.node}

    def _await_end(self) -> bool:
        """A gang node's trainer exited with 0 without the final metrics line, and the broker has
        recorded it: wait (heartbeating) for the job's end, which the broker makes once the node
        whose trainer prints the metrics (global rank 0) reports, or once every node's trainer
        has exited cleanly. True once the job has ended; False if the broker stays unreachable
        for ``end_report_timeout_s`` (the job's lease ends it) or the agent is told to stop."""
        log.info("the trainer ended without final metrics: waiting for the gang's other nodes to end the job")
        answered = time.monotonic()
        while not self.terminating.is_set():
            outcome, target = self._call("heartbeat", self.broker.heartbeat, self.job_id)
            if outcome is Outcome.ENDED or (outcome is Outcome.OK and target.status.terminal):
                return True
            if outcome is not Outcome.TRANSIENT:
                answered = time.monotonic()
            elif time.monotonic() - answered >= self.end_report_timeout_s:
                log.error("the broker stayed unreachable for %gs while the job finished; giving up "
                          "(the job's lease ends it)", self.end_report_timeout_s)
                return False
            self.terminating.wait(self.poll_s)
        return False

    def _finished_nodes(self) -> list[str]:
        """A gang on this host: the nodes whose trainer exited with 0 (the others' may still run:
        global rank 0 evaluates and prints the final metrics after the rest have ended)."""
        assert self.gang is not None
        return [n for n, s in self.gang.statuses().items()
                if protocol.clean_exit(s)]

    def _report_clean_nodes(self) -> None:
        """A gang on this host whose trainer exited with 0 on some of its nodes but not on all:
        each such node is reported once, as a gang of pods' agent reports its own (``finish``
        naming the node, without metrics), so that the broker keeps the job's allocation fixed
        (no resize, no suspension) until the job ends. Once every node has exited the job's end is
        reported as one (:meth:`_report_exit`, with the metrics); a transient failure is retried
        at the next poll."""
        assert self.gang is not None
        finished, using = self._finished_nodes(), self.gang.using()
        if not set(using) - set(finished):
            return  # the gang's end, reported whole at the next poll
        for node in finished:
            if node in self.clean_nodes:
                continue
            outcome, _ = self._call(f"report of node {node}'s clean exit", self.broker.finish,
                                    self.job_id, 0, None, node=node)
            if outcome is not Outcome.TRANSIENT:
                self.clean_nodes.add(node)

    def _log_parser(self) -> LogParser:
        """The parser whose log tells the job's story: a gang's failed node, else the node whose
        trainer printed the metrics (global rank 0), else the rendezvous host's."""
        if self.gang is None:
            return self.parser
        node = (self._status().get("node")
                or next((n for n, p in self.parsers.items() if p.metrics is not None), None)
                or self.gang.rank0.get(self.written) or min(self.gang.dirs))
        return self.parsers[node]

    def _with_tail(self, reason: str) -> str:
        lines = log_excerpt(self._log_parser().tail)
        return f"{reason}. Last log lines:\n{lines}" if lines else reason

    def _report_exit(self, code: int | None) -> int:
        """Report the trainer's own exit (``code``: its exit code, ``None`` when ``status.json`` gave
        none that could be read, which is a failure); 0 once the broker has the job's end."""
        how = f"code {code}" if code is not None else "no readable exit code (status.json)"
        if code != 0 and self._replaced():
            # a pod the broker has moved past (recreated, dropped from the gang, moved away): its
            # trainer died with the generation (a gang's peer pod went first); the job runs on in
            # the pods that replace it, which report its end
            log.info("the trainer exited with %s after this pod was replaced: not the job's end", how)
            return 0
        self._report_progress(contact=True, to_end=True)
        if self.gang is not None and code != 0:  # half a job never runs on: stop the other nodes
            node = self._status().get("node")
            reason = self._with_tail(f"the trainer on node {node} exited with {how}; the gang was stopped")
            if not self._stopped(f"node {node}'s trainer failed"):
                # the other nodes' trainers still run: freeing the job's GPUs now could double-book them
                log.error("the gang's other trainers did not stop: the broker's lease will end the job")
                return 1
            return self._report_end(
                "fail", lambda: self.broker.fail(self.job_id, reason, code),
                lambda: self.broker.fail(self.job_id, f"trainer on node {node} exited with {how}", code),
            )
        if self.gang is not None and not self._stopped("the gang's trainers ended"):
            # a node the last generation dropped may still stop its old trainer (its grace period):
            # the job's GPUs, that node's included, are freed only once it has
            log.error("a node's trainer did not stop: the broker's lease will end the job")
            return 1
        metrics = self._log_parser().metrics
        node = self._node_kw  # a gang of pods: this node's GPUs only, the others' stay held until they report
        if self.node is not None and code == 0 and metrics is None:
            # not the trainer that prints the final metrics (global rank 0 may run on any node):
            # the broker records this node's clean exit and ends the job once the metrics come
            # or every node has exited; this node's GPUs are freed then
            if self._report_end("finish", lambda: self.broker.finish(self.job_id, 0, None, **node)):
                return 1
            return 0 if self._await_end() else 1
        if code == 0:
            return self._report_end(
                "finish", lambda: self.broker.finish(self.job_id, 0, metrics, **node),
                (lambda: self.broker.finish(self.job_id, 0, None, **node)) if metrics else None,
            )
        where = "" if self.node is None else f" on node {self.node}"
        return self._report_failure(f"trainer{where} exited with {how}", code, metrics)

    def _report_failure(self, plain: str, code: int | None = None, metrics: dict[str, Any] | None = None) -> int:
        """Report the job's failure: ``plain`` with the trainer's last log lines, and ``metrics``;
        a rejected report is sent once more as ``plain`` alone (:meth:`_report_end`)."""
        reason, node = self._with_tail(plain), self._node_kw
        return self._report_end("fail", lambda: self.broker.fail(self.job_id, reason, code, metrics, **node),
                                lambda: self.broker.fail(self.job_id, plain, code, **node))

    def _report_end(self, what: str, call: Callable[[], Any], fallback: Callable[[], Any] | None = None) -> int:
        """Report the job's end, retrying transient failures for ``end_report_timeout_s``; a rejected
        report is sent once more as ``fallback`` (without metrics). 0 once the broker has the end."""
        deadline = time.monotonic() + self.end_report_timeout_s
        while True:
            outcome, _ = self._call(what, call)
            if outcome is Outcome.OK:
                return 0
            if outcome is Outcome.ENDED:
                return 0  # the broker ended the job already (lost, cancelled): nothing to report
            if outcome is Outcome.REJECTED:
                if fallback is None:
                    log.error("%s: the broker rejected the report; the job's lease will end it", what)
                    return 1
                call, fallback, what = fallback, None, f"{what} (plain)"
                continue
            if time.monotonic() >= deadline:
                log.error("%s: the broker stayed unreachable for %gs; giving up (the job's lease will end it)",
                          what, self.end_report_timeout_s)
                return 1
            time.sleep(self.poll_s)

    def _stop_ended(self, why: str) -> int:
        """The broker ended the job (cancelled, lost): stop the trainer, then tell the broker it
        stopped, so that the GPUs it holds for the trainer go to other jobs now rather than after
        the lease (a gang of pods, one agent per node: this node's GPUs only); 0."""
        if self._stopped(why):
            self._call("report of the stopped trainer", self.broker.fail, self.job_id,
                       f"the trainer stopped ({why})", **self._node_kw)
        return 0

    def _stopped(self, why: str) -> bool:
        """Stop every launcher's trainer and wait (``stop_timeout_s``) for them; True once every
        launcher reports its trainer stopped or exited, or is gone."""
        log.info("%s: stopping the trainer", why)
        stops.request_stop(self.dir, why)
        if self.gang is not None:
            self.gang.stop()
        deadline = time.monotonic() + self.stop_timeout_s
        frozen_since: float | None = None
        while time.monotonic() < deadline:
            if all(s.get("state") in (protocol.STOPPED, protocol.EXITED) for s in self._launcher_statuses()):
                return True
            # a launcher killed (OOM, SIGKILL) or dead of an error leaves its trainer running
            if (self.launcher_pids and all(not protocol.same_process(p, self.launcher_starts.get(p))
                                           for p in self.launcher_pids)
                    and self._orphans_killed()):
                return True
            # a launcher stopped by SIGSTOP or a debugger neither stops its trainer nor fences it
            frozen = [p for p in self.launcher_pids if (st := protocol.proc_stat(p)) is not None and st[0] in "Tt"
                      and st[1] == self.launcher_starts.get(p)]  # the launcher, not a process that took its pid
            frozen_since = (frozen_since or time.monotonic()) if frozen else None
            if frozen_since is not None and time.monotonic() - frozen_since >= FROZEN_LAUNCHER_S:
                log.warning("launcher(s) %s stopped (SIGSTOP, a debugger) for %.0fs: killing them and their "
                            "trainers", frozen, FROZEN_LAUNCHER_S)
                protocol.signal_processes(frozen, signal.SIGKILL, self.launcher_starts)
                frozen_since = None
            time.sleep(0.2)
        log.warning("the trainer did not stop within %.0fs: the broker keeps its GPUs until the lease ends",
                    self.stop_timeout_s)
        return False

    def _launcher_statuses(self) -> list[dict[str, Any]]:
        """Each launcher's ``status.json``: every node's of a gang on this host, else the one."""
        return list(self.gang.statuses().values()) if self.gang is not None else [self._status()]

    def _orphans_killed(self) -> bool:
        """SIGKILL the trainers and workers of the launchers that have not stopped or exited (called
        once they are no longer alive: from their ``status.json``, pids with start times, so a pid
        another process has now is left alone), and the job's processes that no ``status.json``
        records (a trainer whose launcher was killed before it wrote its pid, a worker started since
        the last record: the local backend marks each with the job's id); True once none is alive."""
        procs = protocol.recorded_processes(self._launcher_statuses())
        for pid in marked_processes(self.job_id):  # never this agent itself
            if pid not in procs and pid not in self.launcher_pids and (stat := protocol.proc_stat(pid)) is not None:
                procs[pid] = stat[1]
        protocol.signal_processes(list(procs), signal.SIGKILL, procs)
        return not protocol.survivors(list(procs), starts=procs)
