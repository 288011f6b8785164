"""Agent: the sidecar that relays between the broker and the launcher's shared directory.

Every ``poll_s`` seconds it heartbeats the broker (which returns the job's
target generation), writes a newer target to ``desired.json``, parses new log
lines into progress samples, acks a generation once ``status.json`` shows the
trainer running on it, and reports the trainer's final exit (``finish`` with
the metrics line, or ``fail`` with the last log lines). If the broker says the
job is cancelled or lost, it tells the launcher to stop.

Progress lines: by default JSON objects with a ``"step"`` key (a JSON object
with ``"final": true`` is kept as the job's metrics); or any line matching
``progress_pattern`` (group ``step``, or its only group).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.states import Target

log = logging.getLogger(__name__)

TAIL_LINES = 20


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
                return float(raw)
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
            self.metrics = obj
        step = obj.get("step")
        return float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


class Agent:
    """Relays one job between ``broker`` and ``shared_dir`` until the job ends.

    :param launcher_pid: the local launcher's pid; if it dies without an exit
        status the job fails (in Kubernetes the pod status plays this part).
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
    ) -> None:
        self.broker = broker
        self.job_id = job_id
        self.dir = shared_dir
        self.parser = LogParser(re.compile(progress_pattern) if progress_pattern else None)
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.launcher_pid = launcher_pid

    def _desired(self) -> dict[str, Any]:
        return protocol.read_json(self.dir / protocol.DESIRED) or {}

    def run(self) -> int:
        """Relay until the job ends; returns 0 when the job's end was reported to the broker."""
        written = int(self._desired().get("generation", 0))
        acked = 0
        status = protocol.read_json(self.dir / protocol.STATUS)
        if status is not None:  # a restarted agent: skip the log already reported
            self.parser.generation = int(status.get("generation", 0))
            self.parser.read(self.dir / protocol.LOG)
        while True:
            try:
                target = self.broker.heartbeat(self.job_id)
            except Exception as exc:  # keep the trainer going through a broker outage
                log.warning("heartbeat failed (%s); retrying", exc)
                time.sleep(self.poll_s)
                continue
            if target.status.terminal:
                return self._stop(f"job is {target.status.value} in the broker")
            if target.generation > written and target.gpus:
                protocol.write_json(
                    self.dir / protocol.DESIRED,
                    {"generation": target.generation, "gpus": target.device_indices(), "stop": False},
                )
                written = target.generation
                log.info("generation %d -> GPUs %s", written, target.device_indices())
            self._report_progress()
            status = protocol.read_json(self.dir / protocol.STATUS) or {}
            gen = int(status.get("generation", 0))
            if status.get("state") == protocol.RUNNING and gen > acked and gen == target.generation:
                self.broker.ack(self.job_id, gen)
                acked = gen
            if status.get("state") == protocol.EXITED:
                return self._report_exit(int(status.get("exit_code") or 0))
            if status.get("state") == protocol.STOPPED:
                self.broker.fail(self.job_id, "the launcher was stopped from outside the broker")
                return 1
            if self.launcher_pid is not None and not protocol.pid_alive(self.launcher_pid):
                time.sleep(self.poll_s)  # it may have written its last status just now
                status = protocol.read_json(self.dir / protocol.STATUS) or {}
                if status.get("state") == protocol.EXITED:
                    return self._report_exit(int(status.get("exit_code") or 0))
                # no launcher to stop it: kill the orphaned trainer and its workers before the GPUs
                # are released, so nothing runs on GPUs the broker hands to another job
                orphans = [p for p in [status.get("pid"), *(status.get("workers") or [])] if p]
                protocol.signal_processes([int(p) for p in orphans], signal.SIGKILL)
                self.broker.fail(self.job_id, self._with_tail(
                    f"the launcher (pid {self.launcher_pid}) died without reporting an exit; "
                    "its trainer was killed"))
                return 1
            time.sleep(self.poll_s)

    def _report_progress(self) -> None:
        samples = self.parser.read(self.dir / protocol.LOG)
        latest: dict[int, float] = {}
        for gen, step in samples:
            latest[gen] = step
        for gen, step in sorted(latest.items()):
            self.broker.progress(self.job_id, step, generation=gen or None)

    def _with_tail(self, reason: str) -> str:
        lines = "\n".join(self.parser.tail)
        return f"{reason}. Last log lines:\n{lines}" if lines else reason

    def _report_exit(self, code: int) -> int:
        self._report_progress()
        if code == 0:
            self.broker.finish(self.job_id, 0, self.parser.metrics)
        else:
            self.broker.fail(
                self.job_id, self._with_tail(f"trainer exited with code {code}"), code, self.parser.metrics
            )
        return 0

    def _stop(self, why: str) -> int:
        log.info("%s: stopping the trainer", why)
        desired = self._desired()
        desired["stop"] = True
        protocol.write_json(self.dir / protocol.DESIRED, desired)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            status = protocol.read_json(self.dir / protocol.STATUS) or {}
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
        poll_s=args.poll_s, launcher_pid=args.launcher_pid,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
