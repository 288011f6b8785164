"""Stops of a job's launchers, by its agent or its backend: ``stop.json`` (see :mod:`.protocol`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from airflow_elastic_gpu.sidecar.protocol import DESIRED, STOP, read_json, write_json


def request_stop(directory: str | os.PathLike[str], why: str) -> None:
    """Ask the launcher of ``directory`` to stop its trainer and exit: write ``stop.json``, then
    set ``stop`` in ``desired.json`` (a launcher of an earlier version reads only that). The first
    write is the one that counts: a generation the agent writes meanwhile cannot erase it."""
    directory = Path(directory)
    write_json(directory / STOP, {"time_s": time.time(), "why": why})
    try:
        desired = read_json(directory / DESIRED) or {"generation": 0, "gpus": []}
    except ValueError:  # malformed: the stop file alone says it
        return
    desired["stop"] = True
    write_json(directory / DESIRED, desired)


def withdraw_stop(directory: str | os.PathLike[str]) -> None:
    """Remove a stop an earlier launcher of the job was given, before a new launcher starts in
    ``directory`` (``stop.json``, and ``stop`` in ``desired.json``; a malformed ``desired.json``
    is removed: the agent writes it anew)."""
    directory = Path(directory)
    (directory / STOP).unlink(missing_ok=True)
    try:
        desired = read_json(directory / DESIRED)
    except ValueError:
        (directory / DESIRED).unlink(missing_ok=True)
        return
    if desired is not None and desired.pop("stop", False):
        write_json(directory / DESIRED, desired)
