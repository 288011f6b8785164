"""The local backend's processes: where a job runs (:class:`LocalHandle`), which recorded pid is
still the job's, finding its unrecorded ones by their mark, and killing them."""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import shutil
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.broker.db import in_memory
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.marks import JOB_MARK, marked_processes

log = logging.getLogger(__name__)

AGENT_MODULE = "airflow_elastic_gpu.sidecar.agent"
"""The module a job's agent runs (``python -m``)."""
LOG_MODE = 0o600
"""The mode of a job's logs (:func:`private_file`)."""
START_LOCK_TIMEOUT_S = 120.0
"""How long a start or stop of a job waits for another one's (seconds): a start spawns a few Python
processes, seconds, a minute on a loaded host."""
STOPPED_WHILE_STARTING: set[str] = set()
"""Jobs whose stop ran inside their start, in the start's thread (a task's on_kill, called from a
signal handler): the start kills what it spawned and fails rather than record it."""


@functools.cache
def host_id() -> str:
    """Where this process sees processes, as a job reference records where the local backend started
    a job: the host name, its ``/etc/machine-id`` where there is one, and the PID namespace (two
    containers may share a name and a machine id, each seeing only its own processes)."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/etc/machine-id").read_text().strip(), lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            continue
    return "/".join(p for p in parts if p)


def started_elsewhere(backend_ref: str | None) -> str | None:
    """The host that local job reference ``backend_ref`` records, where it is not this one (a
    trigger or a retry on another machine of a distributed Airflow); else None (this host, or no
    host recorded: a reference of an older version, or not a local one). Such a job's processes
    cannot be seen, signalled or started again from here: its agent there reports to the broker,
    whose lease ends the job if that host is lost."""
    try:
        host = json.loads(backend_ref or "{}").get("host")
    except (ValueError, AttributeError):
        return None
    return _other_host(host)


def _other_host(host: object) -> str | None:
    """``host`` (a recorded :func:`host_id`) when it is one and not this one, else None."""
    return host if isinstance(host, str) and host != host_id() else None


@functools.cache  # a process does not outlive the boot it started in
def boot_id() -> str | None:
    """This boot of the host (Linux's ``/proc/sys/kernel/random/boot_id``), None where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``);
    None where unknown (no ``/proc``, or the process is gone)."""
    stat = protocol.proc_stat(pid)
    return None if stat is None else stat[1]


def job_process(pid: int | None, job_id: str, *, boot: str | None = None, started: int | None = None) -> bool:
    """True if ``pid`` is alive and may be a process of job ``job_id``: its environment has
    :data:`JOB_MARK` with that id, or none at all (a trainer that cleared its environment, a job
    started by an older version: never taken for gone while it may hold the job's GPUs). Where
    there is no ``/proc`` to tell, alive is enough. A process whose environment cannot be read
    (another user's: ``run_as_user``) is the job's only if it is the recorded one (``started``
    matches): else a reused pid could be taken for it. Taken for gone, a job of another user had
    its GPUs freed while its trainer still ran.

    :param boot: the :func:`boot_id` the pid was recorded in: another boot's pid is no process of
        the job (every one of them ended with that boot), whatever now has it.
    :param started: the pid's :func:`start_ticks` when recorded: a process started at another
        time has the pid now (the job's ended and the pid was reused).
    """
    if not pid or not protocol.pid_alive(pid):
        return False
    if boot is not None and (now := boot_id()) is not None and now != boot:
        return False
    ticks = start_ticks(pid) if started is not None else None
    if ticks is not None and ticks != started:
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc here (else: it has just exited)
    except OSError:
        return ticks is not None  # another user's: the job's if it is the recorded process itself
    marks = [v for v in environ.split(b"\0") if v.startswith(f"{JOB_MARK}=".encode())]
    # no mark at all (started by an older version, or a command that cleared its environment):
    # possibly the job's, as a live pid always counted before; another job's mark: not this job's
    return not marks or f"{JOB_MARK}={job_id}".encode() in marks


def private_file(path: Path, mode: int = LOG_MODE) -> None:
    """Create ``path`` (or keep it) with ``mode``: appenders keep the mode of an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def writable_dir(path: Path, what: str, mode: int = 0o777) -> None:
    """Create ``path`` (the last part with ``mode``, less the umask) if missing.

    :raises BackendError: it cannot be created, or is not a writable directory.
    """
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise BackendError(f"{what} {str(path)!r} cannot be created: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise BackendError(f"{what} {str(path)!r} is not writable")


def check_start(command: str, checkpoint_dir: str | None, work_dir: Path, work_dir_mode: int,
                broker_url: str | None = None) -> None:
    """:meth:`~.local.LocalBackend.check`: a command that cannot start here, a work dir (made with
    ``work_dir_mode`` if missing) or checkpoint dir that cannot be written, a relative checkpoint dir,
    a ``broker_url`` of an in-memory SQLite database, which the job's agent (another process)
    cannot reach (it waited for ever on an empty database of its own).

    :raises BackendError: naming the problem."""
    if broker_url is not None and in_memory(broker_url):
        raise BackendError(f"the broker {broker_url} is an in-memory SQLite database of this process: the job's "
                           "agent, another process, cannot reach it; give a SQLite file or PostgreSQL")
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
    writable_dir(work_dir, "work dir (the parent of the job directories)", work_dir_mode)
    if checkpoint_dir is not None:
        if not Path(checkpoint_dir).is_absolute():  # "~" too: expanded by whom, where?
            raise BackendError(f"checkpoint_dir {checkpoint_dir!r} must be an absolute path: the worker, the "
                               "triggerer and the job's launcher each resolve a relative one from their own directory")
        writable_dir(Path(checkpoint_dir), "checkpoint_dir")


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the agent, launcher and trainer each lead one)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class LocalHandle:
    """Where a local job runs: its directory and the pids of its agent and launcher (a gang job:
    ``node_pids``, node name -> its launcher's pid; ``launcher_pid`` is the first of them).

    :param boot: the host's :func:`boot_id` when they were started (None: unknown, or recorded
        by an older version).
    :param starts: ``(pid, start ticks)`` of the agent and launchers when they were started.
    :param host: the :func:`host_id` they were started on (None: recorded by an older version).
    """

    job_dir: Path
    agent_pid: int
    launcher_pid: int
    node_pids: tuple[tuple[str, int], ...] = ()
    boot: str | None = None
    starts: tuple[tuple[int, int], ...] = ()
    host: str | None = None

    @property
    def elsewhere(self) -> str | None:
        """The host they were started on when it is not this one (:func:`started_elsewhere`)."""
        return _other_host(self.host)

    @property
    def launcher_pids(self) -> list[int]:
        return [pid for _, pid in self.node_pids] or [self.launcher_pid]

    def launcher_dirs(self) -> list[Path]:
        """Each launcher's shared directory (one per node for a gang job)."""
        return [self.job_dir / protocol.NODES / node for node, _ in self.node_pids] or [self.job_dir]

    def owns(self, pid: int | None, started: int | None = None) -> bool:
        """Whether ``pid`` (the handle's, or one its launchers recorded) is still a live process of
        the job (:func:`job_process` with the handle's boot and the pid's start time: ``started``,
        else the handle's)."""
        if started is None:
            started = dict(self.starts).get(pid or 0)
        return job_process(pid, self.job_dir.name, boot=self.boot, started=started)

    def recorded(self) -> dict[int, int | None]:
        """The trainers and workers the job's launchers recorded (:func:`protocol.recorded_processes`
        of their ``status.json``) that are still live processes of the job, pid -> start time."""
        statuses = [protocol.read_json(d / protocol.STATUS) or {} for d in self.launcher_dirs()]
        return {p: t for p, t in protocol.recorded_processes(statuses).items() if self.owns(p, t)}

    def exited_cleanly(self) -> bool:
        """Whether every launcher of the job recorded its trainer's clean exit (``status.json``)."""
        try:
            return all(protocol.clean_exit(protocol.read_json(d / protocol.STATUS) or {}) for d in self.launcher_dirs())
        except (OSError, ValueError):
            return False

    def to_ref(self) -> str:
        data: dict = {"job_dir": str(self.job_dir), "agent_pid": self.agent_pid, "launcher_pid": self.launcher_pid}
        if self.node_pids:
            data["node_pids"] = dict(self.node_pids)
        if self.boot is not None:
            data["boot_id"] = self.boot
        if self.starts:
            data["starts"] = {str(pid): ticks for pid, ticks in self.starts}
        if self.host is not None:
            data["host"] = self.host
        return json.dumps(data)

    @classmethod
    def from_ref(cls, ref: str) -> LocalHandle:
        data = json.loads(ref)
        return cls(Path(data["job_dir"]), int(data["agent_pid"]), int(data["launcher_pid"]),
                   tuple((str(n), int(p)) for n, p in (data.get("node_pids") or {}).items()),
                   data.get("boot_id"), tuple((int(p), int(t)) for p, t in (data.get("starts") or {}).items()),
                   data.get("host"))


def check_started_in(job_id: str, backend: str, backend_ref: str | None, job_dir: Path) -> None:
    """Refuse a start of job ``job_id`` in ``job_dir`` when an earlier start ran it elsewhere: in
    another work directory (a shell or worker whose ``[elastic_gpu] work_dir`` or
    ``$AIRFLOW_HOME`` differs), whose processes a start here would not find by their handle; it
    killed them as strays and trained again from an empty checkpoint directory. Or by another
    backend (``backend``, its reference ``backend_ref`` not a local one).

    :raises BackendError: naming where the job runs.
    """
    from airflow_elastic_gpu.backends.base import BackendError

    if backend_ref is None:
        return
    if (host := started_elsewhere(backend_ref)) is not None:
        raise BackendError(f"job {job_id} was started on host {host}, not this one ({host_id()}): the local "
                           "backend follows and starts a job again only on its own host; run the task's "
                           "workers and triggerer there, or use a backend that reaches every host")
    try:
        recorded = Path(json.loads(backend_ref)["job_dir"])
    except (ValueError, KeyError, TypeError):
        raise BackendError(f"job {job_id} was started by another backend than this local one ({backend!r} job, "
                           f"reference {backend_ref[:80]!r}): it is not started again here") from None
    if recorded.resolve() != job_dir.resolve():
        raise BackendError(f"job {job_id} was started in job directory {recorded}, not {job_dir}: it runs from "
                           f"work directory {recorded.parent} (--work-dir, [elastic_gpu] work_dir); a start in "
                           "another would run a second trainer of it")


def kill_unrecorded(job_id: str, command: str | None = None) -> list[int]:
    """SIGKILL job ``job_id``'s processes that no ``handle.json`` records (:func:`marked_processes`,
    ``command`` as there: a start killed mid-way, with the task's worker, after it spawned them; the
    next start would run a second trainer on the job's GPUs and checkpoint beside them); those that
    survive. Call it once the recorded ones are killed, or with a ``command`` they do not run."""
    strays = marked_processes(job_id, command)
    if not strays:
        return []
    log.warning("job %s: stopping processes %s of an earlier start that did not record them", job_id, strays)
    starts = {pid: start_ticks(pid) for pid in strays}
    protocol.signal_processes(strays, signal.SIGKILL, starts)
    return protocol.survivors(strays, starts=starts)


def kill_job_processes(h: LocalHandle) -> list[int]:
    """SIGKILL every process of the job of handle ``h`` left: its launchers' and agent's groups,
    its trainers' and their workers in sessions of their own (recorded in each launcher's
    ``status.json``), each only if it is still the job's (:meth:`LocalHandle.owns`); the pids
    signalled."""
    pids = [p for p in (*h.launcher_pids, h.agent_pid) if h.owns(p)]
    for pid in pids:
        kill_group(pid)
    recorded = h.recorded()  # with their start times: a pid another process has now is left alone
    for pid in recorded:
        kill_group(pid)  # a trainer leads its group; a worker in a session of its own, its own
    protocol.signal_processes(list(recorded), signal.SIGKILL, recorded)
    return pids + list(recorded)


def start_lock(job_dir: Path) -> FileLock:
    """The job's start lock, also taken by its stop: one per process and path, re-entrant in the
    thread that holds it (a task's on_kill, which Airflow calls from a signal handler in the thread
    that may be in the start, would wait for itself) and exclusive between threads and processes."""
    return FileLock(job_dir / ".start.lock", timeout=START_LOCK_TIMEOUT_S, is_singleton=True)
