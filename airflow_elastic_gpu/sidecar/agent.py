"""Agent: the sidecar that relays between the broker and the launcher's shared directory.

Every ``poll_s`` seconds it heartbeats the broker (which returns the job's
target generation), records the confirmed contact in ``lease.json`` (the
launcher fences the trainer when it grows stale, see ``docs/fencing.md``),
writes a newer target to ``desired.json``, parses new log lines into progress
samples, acks a generation once ``status.json`` shows the trainer running on
it, and reports the trainer's final exit (``finish`` with the metrics line, or
``fail`` with the last log lines). If the broker says the job is cancelled or
lost, it tells the launcher to stop.

The agent never dies of a broker answer: each call's error is classified by
:func:`classify`: a rejected report is dropped with a log line, a transient
failure retried on the next poll, and "the job ended or is unknown" stops the
trainer.

Progress lines: by default JSON objects with a ``"step"`` key (a JSON object
with ``"final": true`` is kept as the job's metrics); or any line matching
``progress_pattern`` (group ``step``, or its only group).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, TypeVar

from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.http_transport import BrokerRejected, JobGone
from airflow_elastic_gpu.states import InvalidRequest, NotFound, Target

log = logging.getLogger(__name__)

T = TypeVar("T")
TAIL_LINES = 20
DEFAULT_LEASE_S = 60.0
"""A new pool's lease in the broker; used when neither the broker's answer nor ``--lease-s`` gives one."""


class Outcome(StrEnum):
    """What a broker call's answer means to the agent."""

    OK = "ok"
    TRANSIENT = "transient"  # the broker did not answer (DB or HTTP unavailable): retry later
    REJECTED = "rejected"  # the broker refused this report (invalid): drop it
    ENDED = "ended"  # the job ended or is unknown to the broker: stop the trainer


def classify(exc: BaseException) -> Outcome:
    """The :class:`Outcome` of a broker call that raised ``exc``.

    :class:`NotFound` (direct DB) and :class:`JobGone` (HTTP 401/403/404/410) mean the job ended
    or is unknown; :class:`InvalidRequest` and other :class:`BrokerRejected` (HTTP 4xx) a rejected
    report; anything else (``BrokerUnavailable``, SQLAlchemy's ``OperationalError``, ``OSError``...)
    is treated as transient: the agent keeps going and never renews the lease on it.
    """
    if isinstance(exc, (NotFound, JobGone)):
        return Outcome.ENDED
    if isinstance(exc, (InvalidRequest, BrokerRejected)):
        return Outcome.REJECTED
    return Outcome.TRANSIENT


class BrokerTransport(Protocol):
    """What the agent needs of the broker: :class:`GpuBroker` itself (direct DB), or an HTTP client."""

    def heartbeat(self, job_id: str) -> Target: ...
    def progress(self, job_id: str, step: float, *, generation: int | None = None,
                 time_s: float | None = None) -> None: ...
    def ack(self, job_id: str, generation: int) -> bool: ...
    def finish(self, job_id: str, exit_code: int = 0, metrics: dict[str, Any] | None = None) -> Any: ...
    def fail(self, job_id: str, reason: str, exit_code: int | None = None,
             metrics: dict[str, Any] | None = None) -> Any: ...


@dataclass
class LogParser:
    """Incremental parser of ``train.log``: progress steps per generation, metrics, last lines."""

    pattern: re.Pattern[str] | None = None
    generation: int = 0
    metrics: dict[str, Any] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    _pos: int = 0
    _partial: str = ""

    def read(self, path: Path) -> list[tuple[int, float]]:
        """New ``(generation, step)`` samples appended to ``path`` since the last call."""
        try:
            with open(path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk.decode("utf-8", "replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        out: list[tuple[int, float]] = []
        for line in lines:
            line = line.rstrip("\r")
            if line:
                self.tail.append(line)
            mark = protocol.parse_generation_line(line)
            if mark is not None:
                self.generation = mark
                continue
            step = self._step(line)
            if step is not None:
                out.append((self.generation, step))
        return out

    def _step(self, line: str) -> float | None:
        if self.pattern is not None:
            m = self.pattern.search(line)
            if not m:
                return None
            raw = m.group("step") if "step" in self.pattern.groupindex else m.group(1)
            try:
                return _finite_step(float(raw))
            except (TypeError, ValueError):
                return None
        if not line.startswith("{"):
            return None
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if obj.get("final"):
            self.metrics = _finite(obj)
        step = obj.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return None
        return _finite_step(float(step))


def _finite_step(step: float) -> float | None:
    """``step``, or ``None`` (dropped with a log line) if it is NaN or infinite."""
    if math.isfinite(step):
        return step
    log.warning("dropped a progress line with a non-finite step (%r)", step)
    return None


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with non-finite numbers replaced by ``None`` (JSON and the broker refuse them)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


class Agent:
    """Relays one job between ``broker`` and ``shared_dir`` until the job ends.

    :param launcher_pid: the local launcher's pid; if it dies without an exit
        status the job fails (in Kubernetes the pod status plays this part). Given, it also means
        the launcher shares this process's pid namespace: the agent's pid goes into ``lease.json``
        so the launcher can tell when the agent is gone.
    :param lease_s: the broker's lease of the job's pool (seconds); a ``lease_s`` in the
        heartbeat answer, where the broker gives one, wins.
    :param fence_s: no confirmed contact for this long and the launcher stops the trainer
        (seconds; default ``lease_s / 2``, see :func:`~airflow_elastic_gpu.sidecar.protocol.fence_periods`).
    :param fence_margin_s: every process of the trainer is dead this long before the lease ends
        (seconds; default ``max(1, lease_s / 10)``).
    :param end_report_timeout_s: how long to retry reporting the trainer's exit through broker
        outages (seconds).
    :param clock: wall clock (epoch seconds) for ``lease.json``; the launcher reads the same clock.
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
        launcher_pid: int | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        fence_s: float | None = None,
        fence_margin_s: float | None = None,
        end_report_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.job_id = job_id
        self.dir = shared_dir
        self.parser = LogParser(re.compile(progress_pattern) if progress_pattern else None)
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.launcher_pid = launcher_pid
        self.fence_s = fence_s
        self.fence_margin_s = fence_margin_s
        self.periods = protocol.fence_periods(lease_s, fence_s, fence_margin_s)
        self.end_report_timeout_s = end_report_timeout_s
        self.clock = clock
        self.pending: dict[int, float] = {}  # generation -> latest step not reported yet
        if poll_s * 3 > self.periods.fence_s:
            log.warning("poll period %gs is long for a fence of %gs: the trainer may be fenced between two "
                        "heartbeats", poll_s, self.periods.fence_s)

    def _desired(self) -> dict[str, Any]:
        return protocol.read_json(self.dir / protocol.DESIRED) or {}

    def _status(self) -> dict[str, Any]:
        return protocol.read_json(self.dir / protocol.STATUS) or {}

    def run(self) -> int:
        """Relay until the job ends; 0 when the job's end was reported to the broker (or the broker
        had ended it), 1 when the end could not be reported or the launcher ended from outside."""
        written = int(self._desired().get("generation", 0))
        acked = 0
        status = protocol.read_json(self.dir / protocol.STATUS)
        if status is not None:  # a restarted agent: skip the log already reported
            self.parser.generation = int(status.get("generation", 0))
            self.parser.read(self.dir / protocol.LOG)
        while True:
            sent_s = self.clock()  # before the call: the broker's record of this contact is later
            outcome, target = self._call("heartbeat", self.broker.heartbeat, self.job_id)
            if outcome is Outcome.ENDED:
                return self._stop("the broker no longer knows the job as running")
            contact = outcome is Outcome.OK
            if contact:
                if target.status.terminal:
                    return self._stop(f"job is {target.status.value} in the broker")
                self._renew(sent_s, target)
                written = self._apply(target, written)
            if self._report_progress(contact) is Outcome.ENDED:
                return self._stop("the broker no longer knows the job as running")
            status = self._status()
            gen = int(status.get("generation", 0))
            if (contact and status.get("state") == protocol.RUNNING and gen > acked
                    and gen == target.generation):
                ack, _ = self._call(f"ack of generation {gen}", self.broker.ack, self.job_id, gen)
                if ack is Outcome.ENDED:
                    return self._stop("the broker no longer knows the job as running")
                if ack is not Outcome.TRANSIENT:  # a rejected ack is not retried
                    acked = gen
            if status.get("state") == protocol.EXITED:
                return self._report_exit(int(status.get("exit_code") or 0))
            if status.get("state") == protocol.STOPPED:
                self._report_end("fail", functools.partial(
                    self.broker.fail, self.job_id, "the launcher was stopped from outside the broker"))
                return 1
            if self.launcher_pid is not None and not protocol.pid_alive(self.launcher_pid):
                time.sleep(self.poll_s)  # it may have written its last status just now
                status = self._status()
                if status.get("state") == protocol.EXITED:
                    return self._report_exit(int(status.get("exit_code") or 0))
                # no launcher to stop it: kill the orphaned trainer and its workers before the GPUs
                # are released, so nothing runs on GPUs the broker hands to another job
                orphans = [p for p in [status.get("pid"), *(status.get("workers") or [])] if p]
                protocol.signal_processes([int(p) for p in orphans], signal.SIGKILL)
                reason = self._with_tail(f"the launcher (pid {self.launcher_pid}) died without reporting "
                                         "an exit; its trainer was killed")
                self._report_end("fail", functools.partial(self.broker.fail, self.job_id, reason))
                return 1
            time.sleep(self.poll_s)

    def _apply(self, target: Target, written: int) -> int:
        """Hand a running job's target to the launcher: a newer generation, or the permission to
        restart a fenced trainer on the generation the broker still runs; the generation written."""
        if target.generation > written and target.gpus:
            protocol.write_json(
                self.dir / protocol.DESIRED,
                {"generation": target.generation, "gpus": target.device_indices(), "stop": False},
            )
            log.info("generation %d -> GPUs %s", target.generation, target.device_indices())
            return target.generation
        status = self._status()
        fences = int(status.get("fences") or 0)
        desired = self._desired()
        if (status.get("state") == protocol.FENCED and int(status.get("generation", 0)) == target.generation
                and target.gpus and int(desired.get("resume", 0)) < fences):
            protocol.write_json(
                self.dir / protocol.DESIRED,
                {"generation": target.generation, "gpus": target.device_indices(), "stop": False,
                 "resume": fences},
            )
            log.info("the broker still runs generation %d: the fenced trainer may restart", target.generation)
        return written

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
        protocol.write_json(self.dir / protocol.LEASE, {
            "contact_s": sent_s, "lease_s": self.periods.lease_s, "fence_s": self.periods.fence_s,
            "kill_s": self.periods.kill_s, "generation": target.generation, "status": target.status.value,
            "agent_pid": os.getpid() if self.launcher_pid is not None else None,
        })

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

    def _report_progress(self, contact: bool) -> Outcome | None:
        """Parse new log lines; with ``contact``, report the latest step of each generation.
        A rejected sample is dropped, a transient failure kept for the next poll; ``ENDED`` if the
        broker no longer knows the job."""
        for gen, step in self.parser.read(self.dir / protocol.LOG):
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

    def _with_tail(self, reason: str) -> str:
        lines = "\n".join(self.parser.tail)
        return f"{reason}. Last log lines:\n{lines}" if lines else reason

    def _report_exit(self, code: int) -> int:
        self._report_progress(contact=True)
        metrics = self.parser.metrics
        if code == 0:
            return self._report_end(
                "finish", lambda: self.broker.finish(self.job_id, 0, metrics),
                (lambda: self.broker.finish(self.job_id, 0, None)) if metrics else None,
            )
        reason = self._with_tail(f"trainer exited with code {code}")
        return self._report_end(
            "fail", lambda: self.broker.fail(self.job_id, reason, code, metrics),
            lambda: self.broker.fail(self.job_id, f"trainer exited with code {code}", code),
        )

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

    def _stop(self, why: str) -> int:
        log.info("%s: stopping the trainer", why)
        desired = self._desired()
        desired["stop"] = True
        protocol.write_json(self.dir / protocol.DESIRED, desired)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            status = self._status()
            if status.get("state") in (protocol.STOPPED, protocol.EXITED):
                break
            if self.launcher_pid is not None and not protocol.pid_alive(self.launcher_pid):
                break
            time.sleep(0.2)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="elastic-GPU sidecar agent")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--shared-dir", required=True, type=Path)
    parser.add_argument("--broker-url", default=None, help="broker DB URL (default: $AIRFLOW_ELASTIC_GPU_BROKER_URL)")
    parser.add_argument("--broker-api", default=os.environ.get("AIRFLOW_ELASTIC_GPU_BROKER_API"),
                        help="broker HTTP API root; with it the agent uses the job's token, not the DB")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding the job's API token (default: $AIRFLOW_ELASTIC_GPU_JOB_TOKEN)")
    parser.add_argument("--progress-pattern", default=None)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--launcher-pid", type=int, default=None)
    parser.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S,
                        help="the broker's lease of the job's pool, seconds (the broker's answer wins where it gives one)")
    parser.add_argument("--fence-s", type=float, default=None,
                        help="stop the trainer after this long without a confirmed contact (default: lease/2)")
    parser.add_argument("--fence-margin-s", type=float, default=None,
                        help="the trainer is dead this long before the lease ends (default: max(1, lease/10))")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker: BrokerTransport
    if args.broker_api:
        from airflow_elastic_gpu.sidecar.http_transport import HttpBrokerTransport

        token = "" if args.token_file else os.environ.get("AIRFLOW_ELASTIC_GPU_JOB_TOKEN", "")
        broker = HttpBrokerTransport(args.broker_api, token, token_file=args.token_file)  # re-read per request
    else:  # direct DB access (the local backend): the broker's code is needed only here
        from airflow_elastic_gpu.broker.service import GpuBroker

        broker = GpuBroker(args.broker_url, migrate=False)
    return Agent(
        broker, args.job_id, args.shared_dir, progress_pattern=args.progress_pattern,
        poll_s=args.poll_s, launcher_pid=args.launcher_pid, lease_s=args.lease_s, fence_s=args.fence_s,
        fence_margin_s=args.fence_margin_s,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
