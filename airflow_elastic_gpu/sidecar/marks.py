"""The job mark: every process of a job carries its id in its environment, so that a job's
processes are found (and only they are killed) whether or not a file records them.

Standard library only, and nothing of the broker: the agent uses it (:mod:`.ends`), as the local
backend does (:mod:`airflow_elastic_gpu.backends.local_processes`)."""

from __future__ import annotations

import os
from pathlib import Path

JOB_MARK = "ELASTIC_GPU_JOB_ID"
"""Set to the job's id in the environment of its agent and launchers, and so of its trainers and
their workers: a pid the job recorded counts as the job's only while its process has it (after a
reboot the pid may be any process's, and the backend must never kill that)."""


def marked_processes(job_id: str, command: str | None = None) -> list[int]:
    """Live processes (readable by this user) whose environment carries job ``job_id``'s
    :data:`JOB_MARK`: its agent, launchers, trainers and their workers, recorded or not (a start
    killed before it wrote ``handle.json``); empty where there is no ``/proc``.

    :param command: only those whose command line has this argument (e.g. the agent's module)."""
    mark = f"{JOB_MARK}={job_id}".encode()
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    found = []
    for pid in entries:
        if pid == os.getpid():
            continue  # a caller that is the job's own (never itself)
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and (
                    command is None or command.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
                found.append(pid)
        except OSError:
            continue  # gone, or another user's
    return found
