"""The demos' long-running processes: each in its own process group, all of them killed at the end.

Every process is started in a new session (so one ``killpg`` reaches it and the children it did
not detach) with a marker variable naming this run in its environment. Processes that leave the
group (a job's agent, launcher and trainer run in sessions of their own) inherit the marker, so
:meth:`ProcessGroups.close` finds and kills them too: nothing the run started outlives it, whether
it ends normally, on an error or on Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import psutil

MARKER = "ELASTIC_GPU_DEMO_RUN"
"""Environment variable that every process of a run (and its descendants) carries."""
HOSTNAME_ENV = "ELASTIC_GPU_DEMO_HOSTNAME"
"""Environment variable naming the host a demo process pretends to run on (see :func:`demo_hostname`)."""


def demo_hostname() -> str:
    """``[core] hostname_callable`` of the demos' Airflow processes: ``$ELASTIC_GPU_DEMO_HOSTNAME``
    (each worker and triggerer gets its own, as if it ran on its own machine), else this host's
    fully qualified name."""
    return os.environ.get(HOSTNAME_ENV) or socket.getfqdn()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessGroups:
    """Named processes, each leading its own process group, logging to ``<log_dir>/<name>.log``.

    Use it as a context manager: leaving the block (normally, on an exception, on Ctrl-C) calls
    :meth:`close`.

    :param log_dir: where the logs go (created).
    :param run_id: the marker value (default: a new random one).
    """

    def __init__(self, log_dir: Path, run_id: str | None = None) -> None:
        self.log_dir = log_dir
        self.run_id = run_id or uuid.uuid4().hex
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this run's marker added."""
        return {**env, MARKER: self.run_id}

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` as process ``name`` in a new session, stdout and stderr to its log.

        :raises ValueError: ``name`` is already taken.
        :raises OSError: the program cannot be started.
        """
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was already started")
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(list(argv), env=self.env(env), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def alive(self, name: str) -> bool:
        """True while process ``name`` (the group's leader) runs."""
        return self.procs[name].poll() is None

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group of ``name`` (a SIGKILL is a machine that dies)."""
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.procs[name].wait()

    def marked(self) -> list[psutil.Process]:
        """Live processes that carry this run's marker (ours and every descendant), but not this one."""
        return marked(self.run_id)

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM every group, SIGKILL what is left after ``grace_s`` seconds, then SIGKILL every
        process that still carries the marker (job agents, launchers, trainers)."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        kill_marked(self.run_id)


def marked(run_id: str) -> list[psutil.Process]:
    """Live processes whose environment carries :data:`MARKER` = ``run_id`` (a demo's processes and
    every descendant: the job agents, launchers and trainers, in sessions of their own), but not
    this one."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(MARKER) == run_id:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def kill_marked(run_id: str) -> int:
    """SIGKILL every process :func:`marked` finds (again while some are left: a process may fork
    while we kill); returns how many were killed."""
    killed = 0
    for _ in range(3):
        left = marked(run_id)
        if not left:
            break
        for p in left:
            try:
                p.kill()
                killed += 1
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)
    return killed
