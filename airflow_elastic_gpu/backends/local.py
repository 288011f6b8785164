"""Local backend: runs a job's agent and launcher on this host as detached processes.

The GPUs are the host's (``nvidia-smi``) or, where there is none, ``N``
*virtual* GPUs: each virtual GPU is one training process (``torchrun
--nproc_per_node={num_gpus}`` with gloo on the CPU), so everything runs on a
laptop. Each job gets a directory ``<work_dir>/<job_id>/`` holding the shared
files of :mod:`airflow_elastic_gpu.sidecar.protocol`, ``agent.log``,
``launcher.log`` and ``handle.json`` (the pids). Both processes start in their
own session through a short-lived spawner, so they outlive the caller (an
Airflow worker slot is freed while the task is deferred) and leave no zombie.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_elastic_gpu.backends.base import BackendError, Problem  # BackendError: also importable from here
from airflow_elastic_gpu.broker.types import JobView
from airflow_elastic_gpu.sidecar import protocol

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker

LOCAL_NODE = "localhost"
"""The node name under which this host's GPUs are registered."""
DEFAULT_VIRTUAL_GPUS = 4
ENV_VIRTUAL_GPUS = "AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS"
_SPAWN = (
    "import subprocess, sys\n"
    "out = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,"
    " start_new_session=True, close_fds=True)\n"
    "print(p.pid)\n"
)


@dataclass(frozen=True)
class HostGpus:
    """GPUs found on this host: device indices, product name, and whether they are virtual."""

    indices: tuple[int, ...]
    gpu_type: str
    virtual: bool


def detect_gpus(virtual_gpus: int | None = None, nvidia_smi: str = "nvidia-smi") -> HostGpus:
    """The host's NVIDIA GPUs via ``nvidia-smi``, else ``virtual_gpus`` virtual ones.

    :param virtual_gpus: count of virtual GPUs when none is found (default
        ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS`` or 4); >= 1.
    :raises ValueError: ``virtual_gpus`` < 1.
    """
    exe = shutil.which(nvidia_smi)
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=index,name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout
            rows = [line.split(",", 1) for line in out.strip().splitlines() if line.strip()]
            if rows:
                return HostGpus(tuple(int(i) for i, _ in rows), rows[0][1].strip(), False)
        except (subprocess.SubprocessError, ValueError, OSError):
            pass
    if virtual_gpus is None:
        virtual_gpus = int(os.environ.get(ENV_VIRTUAL_GPUS, DEFAULT_VIRTUAL_GPUS))
    if virtual_gpus < 1:
        raise ValueError(f"virtual_gpus must be >= 1, got {virtual_gpus}")
    return HostGpus(tuple(range(virtual_gpus)), "virtual", True)


def pool_lease_s(broker: GpuBroker, pool: str) -> float:
    """``pool``'s heartbeat lease in the broker, seconds (what the job's agent fences against).

    A read of the pool's row, until the broker's heartbeat answer carries its lease.

    :raises BackendError: unknown pool.
    """
    from sqlalchemy import select

    from airflow_elastic_gpu.broker.models import GpuPool

    with broker.engine.connect() as conn:
        lease_s = conn.execute(select(GpuPool.lease_s).where(GpuPool.name == pool)).scalar()
    if lease_s is None:
        raise BackendError(f"unknown GPU pool {pool!r}: no lease to fence the job's trainer against")
    return float(lease_s)


@dataclass(frozen=True)
class LocalHandle:
    """Where a local job runs: its directory and the pids of its agent and launcher."""

    job_dir: Path
    agent_pid: int
    launcher_pid: int

    def to_ref(self) -> str:
        return json.dumps({"job_dir": str(self.job_dir), "agent_pid": self.agent_pid,
                           "launcher_pid": self.launcher_pid})

    @classmethod
    def from_ref(cls, ref: str) -> LocalHandle:
        data = json.loads(ref)
        return cls(Path(data["job_dir"]), int(data["agent_pid"]), int(data["launcher_pid"]))


class LocalBackend:
    """Start, watch and stop jobs on this host (the :class:`~airflow_elastic_gpu.backends.base.Backend`
    protocol).

    :param work_dir: parent of the per-job directories.
    :param broker: the broker whose jobs these are (pool registration).
    :param broker_url: the broker DB URL the agents connect with (default: ``broker``'s own URL).
    :param virtual_gpus: GPUs to register when this host has none (see :func:`detect_gpus`).
    :param python: interpreter for the agent and launcher (default: this one).
    :param grace_s: SIGTERM-to-SIGKILL grace for the trainer, seconds (a fence shortens it to fit in
        the lease, see ``docs/fencing.md``).
    :param poll_s: agent poll period, seconds.
    :param fence_s: the agent's fence period, seconds (default: half the pool's lease, which the
        agent is given: the launcher stops the trainer on its own when its agent has had no
        confirmed contact with the broker for this long).
    """

    name = "local"

    def __init__(self, work_dir: str | Path, broker: GpuBroker, *, broker_url: str | None = None,
                 virtual_gpus: int | None = None, python: str = sys.executable, grace_s: float = 30.0,
                 poll_s: float = 1.0, fence_s: float | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.broker = broker
        self.broker_url = broker_url or broker.engine.url.render_as_string(hide_password=False)
        self.virtual_gpus = virtual_gpus
        self.python = python
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.fence_s = fence_s

    def job_dir(self, job_id: str) -> Path:
        return self.work_dir / job_id

    def ensure_pool(self, pool: str) -> str | None:
        """Register this host's GPUs (or virtual ones, see :func:`detect_gpus`) as node
        :data:`LOCAL_NODE` of ``pool`` when the broker has no such pool yet.

        :raises BackendError: ``virtual_gpus`` < 1.
        """
        if pool in self.broker.pools():
            return None
        try:
            found = detect_gpus(self.virtual_gpus)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        self.broker.register_node(LOCAL_NODE, pool=pool, gpu_type=found.gpu_type, gpu_indices=found.indices)
        return (f"registered {len(found.indices)} {'virtual ' if found.virtual else ''}GPU(s) of this host "
                f"in pool {pool!r}")

    def check(self, command: str, checkpoint_dir: str | None) -> None:
        """Fail fast on a command that cannot start here or a checkpoint dir that cannot be written.

        :raises BackendError: the command is empty, does not parse, or its program is not found;
            ``checkpoint_dir`` cannot be created or written.
        """
        try:
            argv = shlex.split(command.replace("{num_gpus}", "1"))
        except ValueError as exc:
            raise BackendError(f"command {command!r} does not parse: {exc}") from None
        if not argv:
            raise BackendError("command is empty")
        if shutil.which(argv[0]) is None:
            raise BackendError(
                f"command not found: {argv[0]!r} (not on PATH and not an executable file); "
                f"full command: {command!r}"
            )
        if checkpoint_dir is None:
            return
        try:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"checkpoint_dir {checkpoint_dir!r} cannot be created: {exc}") from None
        if not os.access(checkpoint_dir, os.W_OK):
            raise BackendError(f"checkpoint_dir {checkpoint_dir!r} is not writable")

    def _spawn(self, log_path: Path, argv: list[str], env: dict[str, str]) -> int:
        out = subprocess.run(
            [self.python, "-c", _SPAWN, str(log_path), *argv],
            capture_output=True, text=True, env=env, check=False, timeout=60,
        )
        if out.returncode != 0:
            raise BackendError(f"could not start {argv[:3]}...: {out.stderr.strip()}")
        return int(out.stdout.strip())

    def start(self, job: JobView, *, env: Mapping[str, str] | None = None,
              context: Mapping[str, str] | None = None) -> str:
        """Start the job's launcher and agent; returns the :class:`LocalHandle` as a reference.

        Idempotent: a job whose agent runs is left as it is. If only the agent died (the launcher
        and trainer still run), only a new agent is started, attached to the running launcher, so
        the job goes on. ``context`` is not used here.

        :raises BackendError: bad command or checkpoint dir, unknown pool, a ``fence_s`` that does not
            fit in the pool's lease, or a spawn failure.
        """
        self.check(job.command, job.checkpoint_dir)
        lease_s = pool_lease_s(self.broker, job.pool)
        try:
            protocol.fence_periods(lease_s, self.fence_s)
        except ValueError as exc:
            raise BackendError(f"fence_s: {exc}") from None
        job_dir = self.job_dir(job.id)
        existing = self.handle(job.id)
        if existing is not None and protocol.pid_alive(existing.agent_pid):
            return existing.to_ref()
        job_dir.mkdir(parents=True, exist_ok=True)
        proc_env = {**os.environ, **(env or {})}
        proc_env.setdefault("OMP_NUM_THREADS", "1")
        if existing is not None and protocol.pid_alive(existing.launcher_pid):
            # the agent died but the trainer runs on: start a new agent for the same launcher
            launcher_pid = existing.launcher_pid
        else:
            launcher = [self.python, "-m", "airflow_elastic_gpu.sidecar.launcher",
                        "--shared-dir", str(job_dir), "--grace-s", str(self.grace_s)]
            if job.checkpoint_dir:
                launcher += ["--checkpoint-dir", job.checkpoint_dir]
            launcher_pid = self._spawn(job_dir / "launcher.log", [*launcher, "--", job.command], proc_env)
        agent = [self.python, "-m", "airflow_elastic_gpu.sidecar.agent", "--job-id", job.id,
                 "--shared-dir", str(job_dir), "--broker-url", self.broker_url,
                 "--poll-s", str(self.poll_s), "--launcher-pid", str(launcher_pid),
                 "--lease-s", repr(lease_s)]
        if self.fence_s is not None:
            agent += ["--fence-s", repr(self.fence_s)]
        if job.progress_pattern:
            agent += ["--progress-pattern", job.progress_pattern]
        agent_pid = self._spawn(job_dir / "agent.log", agent, proc_env)
        handle = LocalHandle(job_dir, agent_pid, launcher_pid)
        protocol.write_json(job_dir / "handle.json", json.loads(handle.to_ref()))
        return handle.to_ref()

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None) -> None:
        """Nothing to do: the job's agent applies the broker's targets itself."""
        return None

    def problem(self, job: JobView) -> Problem | None:
        """The job was started but neither its agent nor its launcher runs any more (a host
        restart, or processes killed by hand)."""
        if job.backend_ref is None or self.is_running(job.id):
            return None
        return Problem("the job's agent and launcher processes are gone (host restart or killed by hand)",
                       gone=True)

    def handle(self, job_id: str) -> LocalHandle | None:
        data = protocol.read_json(self.job_dir(job_id) / "handle.json")
        return None if data is None else LocalHandle.from_ref(json.dumps(data))

    def is_running(self, job_id: str) -> bool:
        """True while the job's agent or launcher process is alive."""
        h = self.handle(job_id)
        return h is not None and (protocol.pid_alive(h.agent_pid) or protocol.pid_alive(h.launcher_pid))

    def stop(self, job_id: str, *, succeeded: bool = False, timeout_s: float | None = None) -> None:
        """Ask the launcher to stop the trainer, then kill whatever is left after ``timeout_s``
        (default ``grace_s`` + 10 s). The job directory is kept (see :meth:`cleanup`)."""
        h = self.handle(job_id)
        if h is None:
            return
        desired = protocol.read_json(h.job_dir / protocol.DESIRED) or {"generation": 0, "gpus": []}
        desired["stop"] = True
        protocol.write_json(h.job_dir / protocol.DESIRED, desired)
        deadline = time.monotonic() + (self.grace_s + 10 if timeout_s is None else timeout_s)
        while time.monotonic() < deadline and protocol.pid_alive(h.launcher_pid):
            time.sleep(0.2)
        status = protocol.read_json(h.job_dir / protocol.STATUS) or {}
        trainer = status.get("pid")
        for pid in (h.launcher_pid, h.agent_pid, trainer):
            if pid and protocol.pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        # workers that run in their own sessions (torchrun's), recorded by the launcher
        protocol.signal_processes([int(p) for p in status.get("workers") or [] if protocol.pid_alive(int(p))],
                                  signal.SIGKILL)

    def log_tail(self, job_id: str, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the trainer's log."""
        path = self.job_dir(job_id) / protocol.LOG
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except FileNotFoundError:
            return []

    def cleanup(self, job_id: str) -> None:
        """Stop the job if needed and delete its directory (checkpoints elsewhere are kept)."""
        self.stop(job_id, timeout_s=5)
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
