"""Local backend: runs a job's agent and launcher on this host as detached processes.

The GPUs are the host's (``nvidia-smi``) or, where there is none, ``N`` *virtual* GPUs: each virtual
GPU is one training process (``torchrun --nproc_per_node={num_gpus}`` with gloo on the CPU), so
everything runs on a laptop. Each job gets a directory ``<work_dir>/<job_id>/`` (mode 0700) holding the shared
files of :mod:`airflow_elastic_gpu.sidecar.protocol`, ``agent.log``,
``launcher.log`` and ``handle.json`` (the pids); the logs are 0600. A job without a
``checkpoint_dir`` checkpoints in ``<work_dir>/checkpoints/<its key>-<hash>/``, shared by the tries
of one Airflow task, so that a retry resumes where the failed try stopped
(:mod:`.local_checkpoints`). Both processes start in their
own session through a short-lived spawner, so they outlive the caller (an
Airflow worker slot is freed while the task is deferred) and leave no zombie.

Secrets: the agent gets the broker's database URL in its environment
(``$AIRFLOW_ELASTIC_GPU_BROKER_URL``, readable by this user only), never on its command line
(which ``ps`` shows to every user). The launcher, and through it the trainer, gets this process's
environment without the variables that hold credentials (:func:`trainer_environment`), so a
trainer cannot reach the broker, nor Airflow's database, connections or variables.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import Timeout

from airflow_elastic_gpu.backends import local_checkpoints
from airflow_elastic_gpu.backends.base import (  # BackendError: also from here
    BackendError,
    Problem,
    check_env,
)
from airflow_elastic_gpu.backends.local_host import (  # re-exported: the backend's public names
    LOCAL_NODE,
    check_host_not_in_another_pool,
    check_pool_of_this_host,
    detect_gpus,
    register_host_gpus,
)
from airflow_elastic_gpu.backends.local_processes import (  # LocalHandle: re-exported
    AGENT_MODULE,
    JOB_MARK,
    START_LOCK_TIMEOUT_S,
    STOPPED_WHILE_STARTING,
    LocalHandle,
    boot_id,
    check_start,
    check_started_in,
    host_id,
    kill_group,
    kill_job_processes,
    kill_unrecorded,
    marked_processes,
    private_file,
    start_lock,
    start_ticks,
    started_elsewhere,
)
from airflow_elastic_gpu.broker.types import BrokerError, JobView, NotFound
from airflow_elastic_gpu.config import ENV_BROKER_URL
from airflow_elastic_gpu.sidecar import protocol, stops
from airflow_elastic_gpu.sidecar.logparse import LogParser
from airflow_elastic_gpu.states import JobStatus

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker

log = logging.getLogger(__name__)

TRAINER_ENV_DROPPED = ("AIRFLOW_ELASTIC_GPU_", "AIRFLOW_CONN_", "AIRFLOW_VAR_", "AIRFLOW__")
"""Prefixes of the variables a trainer does not inherit: this provider's (the broker URL, job
tokens), Airflow's connections and variables, and Airflow's configuration (its database URL,
Fernet key, secret keys)."""
JOB_DIR_MODE = 0o700
_SPAWN = (
    "import subprocess, sys\n"
    "out = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,"
    " start_new_session=True, close_fds=True)\n"
    "print(p.pid)\n"
)


def trainer_environment(environ: Mapping[str, str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a job's launcher and trainer: ``environ`` without the variables named by
    :data:`TRAINER_ENV_DROPPED`, plus ``env`` (the job's own variables, which may set any name),
    and ``OMP_NUM_THREADS=1`` unless set.

    :param environ: the caller's environment (``os.environ``).
    :param env: the job's extra variables (checked with :func:`~airflow_elastic_gpu.backends.base.check_env`).
    """
    out = {k: v for k, v in environ.items() if not k.startswith(TRAINER_ENV_DROPPED)}
    out.update(env or {})
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def pool_lease_s(broker: GpuBroker, pool: str) -> float:
    """``pool``'s heartbeat lease in the broker, seconds (what the job's agent fences against).

    :raises BackendError: unknown pool.
    """
    try:
        return float(broker.pool_config(pool).lease_s)
    except NotFound:
        raise BackendError(f"unknown GPU pool {pool!r}: no lease to fence the job's trainer against") from None


class LocalBackend:
    """Start, watch and stop jobs on this host (the :class:`~airflow_elastic_gpu.backends.base.Backend`
    protocol).

    :param work_dir: parent of the per-job directories.
    :param broker: the broker whose jobs these are (pool registration).
    :param broker_url: the broker DB URL the agents connect with (default: ``broker``'s own URL);
        handed to them in their environment, never on their command line.
    :param virtual_gpus: GPUs to register when this host has none (see :func:`detect_gpus`).
    :param virtual_nodes: split the virtual GPUs into this many nodes of ``virtual_gpus`` each
        (``localhost-0``, ``localhost-1``, ...; >= 1): a job larger than a node then runs as a gang,
        one launcher per node (:mod:`airflow_elastic_gpu.sidecar.gang`).
    :param python: interpreter for the agent and launcher (default: this one).
    :param grace_s: SIGTERM-to-SIGKILL grace for the trainer, seconds (a fence shortens it to fit in
        the lease, see ``docs/fencing.md``).
    :param poll_s: agent poll period, seconds.
    :param fence_s: the agent's fence period, seconds (default: half the pool's lease, which the
        agent is given: the launcher stops the trainer on its own when its agent has had no
        confirmed contact with the broker for this long).
    """

    name = "local"
    stop_releases = True  # a stop frees an ended job's held GPUs once its processes are gone

    def __init__(self, work_dir: str | Path, broker: GpuBroker, *, broker_url: str | None = None,
                 virtual_gpus: int | None = None, virtual_nodes: int = 1, python: str = sys.executable,
                 grace_s: float = 30.0, poll_s: float = 1.0, fence_s: float | None = None) -> None:
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise BackendError(f"virtual_nodes must be an integer >= 1, got {virtual_nodes!r}")
        self.virtual_nodes = virtual_nodes
        self.work_dir = Path(work_dir).expanduser().absolute()  # recorded in job refs: the same from any cwd
        self.broker = broker
        self.broker_url = broker_url or broker.url
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

        :raises BackendError: ``virtual_gpus`` < 1, or this host's GPUs are already a node of another
            pool, or the real ones of another broker (:func:`claim_host_gpus`): handed out twice."""
        if pool in self.broker.pools():
            check_pool_of_this_host(self.work_dir, self.broker, pool)
            return None
        check_host_not_in_another_pool(self.broker, pool)
        try:
            found = detect_gpus(self.virtual_gpus)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        if not found.virtual and self.virtual_nodes > 1:
            raise BackendError("virtual_nodes > 1 splits virtual GPUs; this host has real ones")
        if self.virtual_nodes == 1:
            register_host_gpus(self.work_dir, self.broker, pool, found)
            return (f"registered {len(found.indices)} {'virtual ' if found.virtual else ''}GPU(s) of this host "
                    f"in pool {pool!r}")
        size = len(found.indices)
        for i in range(self.virtual_nodes):  # device indices unique on the host: node i has i*size ...
            self.broker.register_node(f"{LOCAL_NODE}-{i}", pool=pool, gpu_type=found.gpu_type,
                                      gpu_indices=tuple(range(i * size, (i + 1) * size)))
        return (f"registered {self.virtual_nodes} virtual nodes of {size} virtual GPU(s) each in pool {pool!r}")

    def gang_nodes(self, job: JobView) -> list[str]:
        """The nodes a job runs a launcher on when it is larger than a node of its pool (a gang);
        empty for a job that fits on one node (one launcher, in the job directory itself)."""
        sizes = {n.name: len(n.gpus) for n in self.broker.nodes(job.pool)}
        if not sizes or job.max_gpus <= max(sizes.values()):
            return []
        return sorted(sizes)

    def check(self, command: str, checkpoint_dir: str | None) -> None:
        """Fail fast on a command that cannot start here, or a work dir or checkpoint dir that
        cannot be written (the work dir is created, mode 0700, if missing).

        :raises BackendError: the command is empty, does not parse, or its program is not found;
            the work dir or ``checkpoint_dir`` cannot be created or written, or ``checkpoint_dir``
            is not an absolute path; the broker is in memory (see :func:`.check_start`).
        """
        check_start(command, checkpoint_dir, self.work_dir, JOB_DIR_MODE, self.broker_url)

    def _spawn(self, log_path: Path, argv: list[str], env: dict[str, str]) -> int:
        private_file(log_path)
        try:
            out = subprocess.run(
                [self.python, "-c", _SPAWN, str(log_path), *argv],
                capture_output=True, text=True, env=env, check=False, timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise BackendError(f"could not start {argv[:3]}...: {exc}") from None
        if out.returncode != 0:
            raise BackendError(f"could not start {argv[:3]}...: {out.stderr.strip()}")
        return int(out.stdout.strip())

    def start(self, job: JobView, *, env: Mapping[str, str] | None = None,
              context: Mapping[str, str] | None = None) -> str:
        """Start the job's launcher and agent; returns the :class:`LocalHandle` as a reference.

        Idempotent: a job whose agent runs is left as it is. If only the agent died (the launcher
        and trainer still run), only a new agent is started, attached to the running launcher, so
        the job goes on. ``context`` is not used here.

        The launcher and trainer get :func:`trainer_environment` (no broker URL, no Airflow
        secrets) plus ``env``; the agent gets the broker URL in its environment only.

        :raises BackendError: bad command, env, work dir or checkpoint dir, unknown pool, a
            ``fence_s`` that does not fit in the pool's lease, or a spawn failure.
        """
        STOPPED_WHILE_STARTING.discard(job.id)
        env = check_env(env)
        self.check(job.command, job.checkpoint_dir)
        lease_s = pool_lease_s(self.broker, job.pool)
        try:
            protocol.fence_periods(lease_s, self.fence_s)
        except ValueError as exc:
            raise BackendError(f"fence_s: {exc}") from None
        job_dir = self.job_dir(job.id)
        check_started_in(job.id, job.backend, job.backend_ref, job_dir)
        try:
            job_dir.mkdir(mode=JOB_DIR_MODE, exist_ok=True)
            job_dir.chmod(JOB_DIR_MODE)
            private_file(job_dir / protocol.LOG)
        except OSError as exc:
            raise BackendError(f"job directory {job_dir} cannot be created: {exc}") from None
        # one start of a job at a time (a trigger run in two triggerers for a moment, a cleared
        # task's new try reattaching while the old one starts): each would see no handle yet and
        # start a trainer of its own on the job's GPUs
        try:
            with start_lock(job_dir):
                return self._start_locked(job, job_dir, env, lease_s)
        except Timeout:
            raise BackendError(f"job {job.id}: another start of it has held {job_dir / '.start.lock'} for "
                               f"{START_LOCK_TIMEOUT_S:.0f}s") from None

    def _start_locked(self, job: JobView, job_dir: Path, env: Mapping[str, str], lease_s: float) -> str:
        """:meth:`start` under the job's start lock."""
        existing = self.handle(job.id)
        if existing is not None and existing.owns(existing.agent_pid):
            return existing.to_ref()
        if existing is not None and (host := existing.elsewhere):  # a work dir shared with that host
            raise BackendError(f"job {job.id} was started on host {host}: its processes there are not seen from here")
        # read again under the lock: a stop (a cancel) that held it just now has ended the job and
        # freed its GPUs, which another job may hold already; the caller read the job before
        if (now := self.broker.job(job.id)).status.terminal:
            raise BackendError(f"job {job.id} is {now.status.value}: not started again")
        new_launcher = existing is None or not all(existing.owns(p) for p in existing.launcher_pids)
        if not new_launcher:
            # the agent died but the trainer runs on: start a new agent for the same launcher(s),
            # and none beside one that a start killed mid-way had spawned
            kill_unrecorded(job.id, AGENT_MODULE)
            launcher_pid, node_pids = existing.launcher_pid, existing.node_pids
        else:
            # part of a gang is gone: start the whole gang again, killing its trainers and workers
            # too (sessions of their own), and what a start killed mid-way spawned unrecorded, else
            # the new trainers would share GPUs and a checkpoint with them
            alive = protocol.survivors(kill_job_processes(existing)) if existing is not None else []
            if alive := alive + kill_unrecorded(job.id):
                raise BackendError(f"job {job.id}: its earlier processes {alive} survive SIGKILL (stuck in the "
                                   "kernel?): not starting a second trainer on their GPUs")
            launcher_pid, node_pids = self._start_launchers(job, job_dir, env)
        pids = [pid for _, pid in node_pids] or [launcher_pid]
        agent = [self.python, "-m", AGENT_MODULE, "--job-id", job.id, "--shared-dir", str(job_dir), "--poll-s", str(self.poll_s),
                 *(a for pid in pids for a in ("--launcher-pid", str(pid))), "--lease-s", repr(lease_s),
                 "--stop-timeout-s", repr(max(60.0, self.grace_s + 10))]  # a stop waits out the launcher's grace
        if self.fence_s is not None:
            agent += ["--fence-s", repr(self.fence_s)]
        if job.progress_pattern:
            agent += ["--progress-pattern", job.progress_pattern]
        # the broker URL in the environment (readable by this user only), not in argv (which ps shows)
        agent_env = {**os.environ, ENV_BROKER_URL: self.broker_url, JOB_MARK: job.id}
        agent_env.setdefault("OMP_NUM_THREADS", "1")
        try:
            agent_pid = self._spawn(job_dir / "agent.log", agent, agent_env)
        except BackendError:
            if new_launcher:  # no agent will ever tell it what to run: leave no idle launcher behind
                for pid in pids:
                    kill_group(pid)
            raise
        if job.id in STOPPED_WHILE_STARTING:  # its stop ran inside this start (a task's on_kill)
            kill_unrecorded(job.id)
            raise BackendError(f"job {job.id} was stopped while it started")
        # the boot and start times tell these processes from any that get their pids later
        handle = LocalHandle(job_dir, agent_pid, launcher_pid, node_pids, boot_id(),
                             tuple((p, t) for p in (agent_pid, *pids) if (t := start_ticks(p)) is not None), host_id())
        protocol.write_json(job_dir / "handle.json", json.loads(handle.to_ref()))
        return handle.to_ref()

    def _start_launchers(self, job: JobView, job_dir: Path,
                         env: Mapping[str, str]) -> tuple[int, tuple[tuple[str, int], ...]]:
        """Start the job's launcher, or one per node for a gang job (:meth:`gang_nodes`), each in
        its own directory with the job's one checkpoint directory; ``(first pid, node pids)``."""
        nodes = self.gang_nodes(job)
        dirs = [(node, job_dir / protocol.NODES / node) for node in nodes] or [("", job_dir)]
        checkpoint_dir = job.checkpoint_dir or str(local_checkpoints.claim(
            self.default_checkpoint_dir(job), job.id, self._earlier_runs, self.grace_s + 10, self._succeeded))
        node_pids: list[tuple[str, int]] = []
        # the earlier launchers' targets and lease, and a gang's agent's record of what it wrote: the new
        # launchers wait for the new agent's first word, and that agent writes the broker's target again
        for stale in (d / f for d in {job_dir, *(s for _, s in dirs)} for f in (protocol.DESIRED, protocol.LEASE)):
            stale.unlink(missing_ok=True)
        try:
            for node, shared in dirs:
                shared.mkdir(mode=JOB_DIR_MODE, parents=True, exist_ok=True)
                private_file(shared / protocol.LOG)
                stops.withdraw_stop(shared)
                launcher = [self.python, "-m", "airflow_elastic_gpu.sidecar.launcher",
                            "--shared-dir", str(shared), "--grace-s", str(self.grace_s)]
                if checkpoint_dir:
                    launcher += ["--checkpoint-dir", checkpoint_dir]
                pid = self._spawn(shared / "launcher.log", [*launcher, "--", job.command],
                                  {**trainer_environment(os.environ, env), JOB_MARK: job.id})
                node_pids.append((node, pid))
        except (BackendError, OSError) as exc:
            for _, pid in node_pids:  # half a gang never runs
                kill_group(pid)
            raise exc if isinstance(exc, BackendError) else BackendError(f"job directory: {exc}") from None
        return node_pids[0][1], tuple(node_pids) if nodes else ()

    def default_checkpoint_dir(self, job: JobView) -> Path:
        """Where a job without ``checkpoint_dir`` checkpoints (:mod:`.local_checkpoints`): one
        directory per task key, so that a retried task resumes where the failed try stopped."""
        return local_checkpoints.default_dir(self.work_dir, job)

    def _succeeded(self, job_id: str) -> bool:
        """:raises BackendError: the broker cannot say (a wrong guess would resume a new run at a
        success's final step, or rename a failed try's checkpoint away from its retry)."""
        try:
            return self.broker.job(job_id).status is JobStatus.SUCCEEDED
        except NotFound:
            return False  # another broker's job, or one its database no longer has: not known to succeed
        except BrokerError as exc:
            raise BackendError(f"cannot tell whether job {job_id}, which used the checkpoint directory "
                               f"last, succeeded: {exc}") from None

    def _keep_checkpoints_of_a_success(self, job_id: str) -> None:
        try:
            job = self.broker.job(job_id)
        except BrokerError:
            return
        if job.checkpoint_dir is None:
            local_checkpoints.keep_after_success(self.default_checkpoint_dir(job), job_id)

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None) -> None:
        """Nothing to do: the job's agent applies the broker's targets itself."""

    def problem(self, job: JobView) -> Problem | None:
        """The job was started but neither its agent nor its launcher runs any more (a host restart, or
        processes killed by hand); None for another host's job unless it exited cleanly (the lease tells)."""
        if job.backend_ref is None or self.is_running(job.id):
            return None
        h = self.handle(job.id)
        if h is not None and h.exited_cleanly():
            parser = LogParser(re.compile(job.progress_pattern) if job.progress_pattern else None)
            parser.skip(self.log_path(job.id))  # its end: the final metrics line
            return Problem("the trainer had exited cleanly, and its agent is gone without reporting it",
                           gone=True, finished=parser.metrics or {})
        if started_elsewhere(job.backend_ref):
            return None
        # a trainer (or worker) left running by its dead launcher: the job keeps its GPUs until the
        # stop that follows has killed it (a process stuck in the kernel may outlive SIGKILL)
        return Problem("the job's agent and launcher processes are gone (host restart or killed by hand)",
                       gone=True, running=h is not None and bool(h.recorded()))

    def handle(self, job_id: str) -> LocalHandle | None:
        data = protocol.read_json(self.job_dir(job_id) / "handle.json")
        return None if data is None else LocalHandle.from_ref(json.dumps(data))

    def is_running(self, job_id: str) -> bool:
        """True while the job's agent or a launcher process is alive (:meth:`LocalHandle.owns`)."""
        h = self.handle(job_id)
        return h is not None and any(h.owns(p) for p in (h.agent_pid, *h.launcher_pids))

    def has_processes(self, job_id: str) -> bool:
        """True while any process of the job is alive: its agent, a launcher, a trainer or worker recorded or
        with its mark (left when its launcher was killed). What a cleanup and a checkpoint claim wait for."""
        h = self.handle(job_id)
        return self.is_running(job_id) or bool(h is not None and h.recorded()) or bool(marked_processes(job_id))

    def _earlier_runs(self, job_id: str) -> bool:
        """Whether the job that used a checkpoint directory before still runs: the leftovers of one
        that has ended with its agent and launchers gone (nothing else will stop them) are killed."""
        if not self.is_running(job_id) and self.has_processes(job_id) and self._ended(job_id):
            if (h := self.handle(job_id)) is not None:
                kill_job_processes(h)
            kill_unrecorded(job_id)  # and waits for them
        return self.has_processes(job_id)

    def _ended(self, job_id: str) -> bool:
        """Whether the broker has ended the job (False for a job it does not know: another broker's)."""
        try:
            return self.broker.job(job_id).status.terminal
        except BrokerError:
            return False

    def stop(self, job_id: str, *, succeeded: bool = False, timeout_s: float | None = None) -> None:
        """Ask the launcher(s) to stop the trainer, then kill whatever is left after ``timeout_s``
        (default ``grace_s`` + 10 s). The job directory is kept (see :meth:`cleanup`); with
        ``succeeded``, the default checkpoint directory is renamed out of the task's way
        (:meth:`default_checkpoint_dir`). It holds the job's start lock (waiting for a start under
        way, whose processes it would miss otherwise) until the job's processes are gone."""
        if not self.job_dir(job_id).is_dir():  # nothing spawned here: a failed first start's GPUs freed
            self._report_stopped(job_id, [], unstarted=True)
            return
        lock = start_lock(self.job_dir(job_id))
        try:
            lock.acquire()
        except (Timeout, RuntimeError) as exc:  # held for long; or this thread waits for it (on_kill in a start)
            log.warning("job %s: stopping without its start lock (%s)", job_id, exc)
            STOPPED_WHILE_STARTING.add(job_id)  # a start of it under way in this process then stops too
            self._stop_locked(job_id, succeeded, timeout_s)
            return
        try:
            if lock.lock_counter > 1:  # re-entered: on_kill's, from a signal handler inside a start
                STOPPED_WHILE_STARTING.add(job_id)  # which then stops too
            self._stop_locked(job_id, succeeded, timeout_s)
        finally:
            lock.release()

    def _stop_locked(self, job_id: str, succeeded: bool, timeout_s: float | None) -> None:
        """:meth:`stop` under the job's start lock."""
        h = self.handle(job_id)
        if h is None:  # never started, or a start that failed before it recorded what it spawned
            self._report_stopped(job_id, kill_unrecorded(job_id))  # the survivors: none reported
            return
        for d in {h.job_dir, *h.launcher_dirs()}:
            stops.request_stop(d, "the job was stopped by its backend")
        if h.elsewhere:  # a work directory shared with its host: its launchers stop it
            return
        deadline = time.monotonic() + (self.grace_s + 10 if timeout_s is None else timeout_s)
        while time.monotonic() < deadline and any(h.owns(p) for p in h.launcher_pids):
            time.sleep(0.2)
        self._report_stopped(job_id, kill_job_processes(h) + kill_unrecorded(job_id))
        if succeeded:
            self._keep_checkpoints_of_a_success(job_id)

    def _report_stopped(self, job_id: str, pids: list[int], *, unstarted: bool = False) -> None:
        """Once every process of an ended job (cancelled: the broker holds its GPUs until its
        trainer stops) is gone, tell the broker, so that the GPUs go to other jobs now (with
        ``unstarted``: only of a job the broker never recorded as started)."""
        if protocol.survivors(pids):
            return  # the broker frees the GPUs a lease after the job's last heartbeat
        try:
            job = self.broker.job(job_id)
            if job.status.terminal and (job.in_use_gpus or job.target_gpus) and not (unstarted and job.backend_ref):
                self.broker.fail(job_id, "its processes were stopped by the backend")
        except Exception as exc:  # noqa: BLE001 - the lease frees them anyway
            log.warning("could not report job %s's stopped processes to the broker: %s", job_id, exc)

    def log_path(self, job_id: str) -> Path:
        """The trainer's log: the job directory's, or, of a gang, the longest node log (the node
        whose trainer holds global rank 0 prints the progress; a rendezvous may put it on any node)."""
        h = self.handle(job_id)
        if h is not None and h.node_pids:
            def size(path: Path) -> int:
                return path.stat().st_size if path.exists() else -1
            return max((d / protocol.LOG for d in h.launcher_dirs()), key=size)
        return self.job_dir(job_id) / protocol.LOG

    def log_tail(self, job_id: str, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the trainer's log (a gang's: rank 0's)."""
        path = self.log_path(job_id)
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

