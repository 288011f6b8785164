"""The local backend's processes: which recorded pid is still a job's, and killing one's group."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from airflow_elastic_gpu.sidecar import protocol

JOB_MARK = "ELASTIC_GPU_JOB_ID"
"""Set to the job's id in the environment of its agent and launchers, and so of its trainers and
their workers: a pid the job recorded counts as the job's only while its process has it (after a
reboot the pid may be any process's, and the backend must never kill that)."""


def job_process(pid: int | None, job_id: str) -> bool:
    """True if ``pid`` is alive and may be a process of job ``job_id``: its environment has
    :data:`JOB_MARK` with that id, or none at all (a trainer that cleared its environment, a job
    started by an older version: never taken for gone while it may hold the job's GPUs). Where
    there is no ``/proc`` to tell, alive is enough; a process whose environment cannot be read
    (another user's) is not the job's."""
    if not pid or not protocol.pid_alive(pid):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc here (else: it has just exited)
    except OSError:
        return False
    marks = [v for v in environ.split(b"\0") if v.startswith(f"{JOB_MARK}=".encode())]
    # no mark at all (started by an older version, or a command that cleared its environment):
    # possibly the job's, as a live pid always counted before; another job's mark: not this job's
    return not marks or f"{JOB_MARK}={job_id}".encode() in marks


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the agent, launcher and trainer each lead one)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
