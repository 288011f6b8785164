"""Job traces: CSV files with one submitted training job per row.

Columns (as in the shared Philly and ITP traces): ``job_id`` (any text),
``submit_time_s`` (seconds, 0 to :data:`MAX_SUBMIT_S`), ``num_gpus`` (requested GPUs, integer >= 1),
``duration_s`` (run time on ``num_gpus``, seconds > 0, at most :data:`MAX_DURATION_S`), and optionally ``model``
(a profile name). Other columns are ignored.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REQUIRED_COLUMNS = ("job_id", "submit_time_s", "num_gpus", "duration_s")
MAX_SUBMIT_S = 1e12
"""The latest submit time a trace may hold (seconds, 31,700 years; epoch seconds fit): at 1e20 a
minute is below a float's resolution, and the simulator's clock stood still, for ever."""
MAX_DURATION_S = 1e8
"""The longest run time a trace job may have (seconds, about three years): the simulator steps
through a job's run, and one of 1e300 s never ended."""


class TraceError(ValueError):
    """A trace file is missing, malformed or holds an impossible value; the message says where."""


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace.

    :param job_id: unique id within the trace.
    :param submit_time_s: submit time, seconds from the trace's start.
    :param num_gpus: GPUs the job asked for (what a static scheduler gives it).
    :param duration_s: run time in seconds on ``num_gpus`` GPUs, as recorded by the source.
    :param model: throughput-profile name, or ``None`` (one is drawn for it).
    """

    job_id: str
    submit_time_s: float
    num_gpus: int
    duration_s: float
    model: str | None = None

    @property
    def gpu_time_s(self) -> float:
        return self.num_gpus * self.duration_s


def load_trace(path: str | Path) -> list[TraceJob]:
    """Read a trace CSV, sorted by submit time.

    :raises TraceError: missing file or column, a non-numeric, negative, zero or
        non-integer value where one is not allowed, a duplicate job id, or no rows.
        The message names the file, the line and the column.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} does not exist")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise TraceError(
                f"{path}: missing column(s) {', '.join(missing)}; a trace needs "
                f"{', '.join(REQUIRED_COLUMNS)} (and optionally model)"
            )
        jobs: list[TraceJob] = []
        seen: set[str] = set()
        for line, row in enumerate(reader, start=2):
            jobs.append(_parse_row(path, line, row, seen))
    if not jobs:
        raise TraceError(f"{path}: the trace has no jobs")
    return sorted(jobs, key=lambda j: (j.submit_time_s, j.job_id))


def _parse_row(path: Path, line: int, row: dict[str, str], seen: set[str]) -> TraceJob:
    def number(column: str) -> float:
        raw = (row.get(column) or "").strip()
        try:
            value = float(raw)
        except ValueError:
            raise TraceError(f"{path}:{line}: {column} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise TraceError(f"{path}:{line}: {column} must be finite, got {raw!r}")
        return value

    job_id = (row.get("job_id") or "").strip()
    if not job_id:
        raise TraceError(f"{path}:{line}: job_id is empty")
    if job_id in seen:
        raise TraceError(f"{path}:{line}: job_id {job_id!r} appears twice")
    seen.add(job_id)
    submit = number("submit_time_s")
    if not 0 <= submit <= MAX_SUBMIT_S:
        raise TraceError(f"{path}:{line}: submit_time_s must be >= 0 and at most {MAX_SUBMIT_S:g}, got {submit:g}")
    gpus = number("num_gpus")
    if gpus < 1 or gpus != int(gpus):
        raise TraceError(f"{path}:{line}: num_gpus must be an integer >= 1, got {row['num_gpus']!r}")
    duration = number("duration_s")
    if not 0 < duration <= MAX_DURATION_S:
        raise TraceError(f"{path}:{line}: duration_s must be > 0 and at most {MAX_DURATION_S:g}, got {duration:g}")
    model = (row.get("model") or "").strip() or None
    return TraceJob(job_id, submit, int(gpus), duration, model)


def _num(x: float) -> str:
    """Exact text for a number: integers without a point, others as Python's shortest round-trip repr."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def write_trace(path: str | Path, jobs: Iterable[TraceJob]) -> Path:
    """Write ``jobs`` as a trace CSV (with the ``model`` column); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*REQUIRED_COLUMNS, "model"])
        for j in jobs:
            w.writerow([j.job_id, _num(j.submit_time_s), j.num_gpus, _num(j.duration_s), j.model or ""])
    return path
