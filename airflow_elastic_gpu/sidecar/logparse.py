"""The agent's incremental reader of a trainer's log: progress steps per generation, metrics, last lines.

Progress lines: by default JSON objects with a ``"step"`` key; or any line matching
``progress_pattern`` (group ``step``, or its only group). Either way a JSON object with
``"final": true`` is kept as the job's metrics. A line of :func:`~.protocol.generation_line` marks
where a generation starts.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_elastic_gpu.sidecar import protocol

log = logging.getLogger(__name__)

TAIL_LINES = 20
"""Lines of the log kept for a failure's reason."""
READ_BYTES = 8 << 20
"""The most of the log one :meth:`LogParser.read` takes (the rest waits for the next poll): a
restarted agent or a long pause met gigabytes, read, decoded and split at once (memory about six
times the size, a minute without a heartbeat)."""
PARTIAL_CHARS = 64 << 10
"""The most of an unfinished line kept between reads (its end): a progress bar redrawn with
``\r`` for hours is one line that never ends."""
SKIP_KEEP_BYTES = 1 << 20
"""What :meth:`LogParser.skip` reads of the log's end: its last lines and final metrics."""
_LINE_END = re.compile(r"(\r\n|\r|\n)")


@dataclass
class LogParser:
    """Incremental parser of ``train.log``: progress steps per generation, metrics, last lines."""

    pattern: re.Pattern[str] | None = None
    generation: int = 0
    metrics: dict[str, Any] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    _pos: int = 0
    _partial: str = ""
    _redrawn: str = ""  # the last drawing of a line redrawn with \r, until the line ends
    behind: bool = False  # the last read stopped at READ_BYTES: more of the log is waiting

    def read(self, path: Path) -> list[tuple[int, float]]:
        """New ``(generation, step)`` samples appended to ``path`` since the last call (at most
        :data:`READ_BYTES` of it). Lines end with ``\n``, ``\r\n`` or ``\r`` (a progress bar
        that redraws itself: each drawing is a line)."""
        try:
            with open(path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read(READ_BYTES)
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        self.behind = len(chunk) == READ_BYTES
        return self._lines(chunk.decode("utf-8", "replace"))

    def read_all(self, path: Path) -> list[tuple[int, float]]:
        """:meth:`read` until the end of ``path`` (a trainer that has exited: its last lines and
        final metrics may lie past one read's :data:`READ_BYTES`)."""
        out = self.read(path)
        while self.behind:
            out += self.read(path)
        return out

    def skip(self, path: Path) -> None:
        """Take ``path`` as read (a restarted agent: its progress was reported before), learning
        the generation marks, final metrics and last lines of its last :data:`SKIP_KEEP_BYTES` only."""
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - SKIP_KEEP_BYTES))
                chunk = f.read(SKIP_KEEP_BYTES)
                self._pos = f.tell()
        except FileNotFoundError:
            return
        text = chunk.decode("utf-8", "replace")
        self._lines(text if size <= SKIP_KEEP_BYTES else _LINE_END.split(text, 1)[-1])  # from a whole line

    def feed(self, text: str) -> list[tuple[int, float]]:
        """Parse ``text`` as the log's next part (a log read elsewhere: a pod's, through its API)."""
        return self._lines(text)

    def _lines(self, text: str) -> list[tuple[int, float]]:
        """Parse the lines ``text`` completes. Each drawing of a line redrawn with ``\r`` is parsed;
        the tail keeps what a terminal would show of it (its last drawing)."""
        pieces = _LINE_END.split(self._partial + text)
        self._partial = pieces.pop()[-PARTIAL_CHARS:]
        out: list[tuple[int, float]] = []
        for line, end in zip(pieces[::2], pieces[1::2], strict=True):
            if end == "\r":
                self._redrawn = line or self._redrawn
            else:
                shown, self._redrawn = line or self._redrawn, ""
                if shown:
                    self.tail.append(shown)
            mark = protocol.parse_generation_line(line)
            if mark is not None:
                self.generation = mark
                continue
            step = self._step(line)
            if step is not None:
                out.append((self.generation, step))
        return out

    def _step(self, line: str) -> float | None:
        obj = _json_object(line)
        if obj is not None and obj.get("final"):  # the final metrics line, with a pattern or without
            self.metrics = _finite(obj)
        if self.pattern is not None:
            m = self.pattern.search(line)
            if not m:
                return None
            raw = m.group("step") if "step" in self.pattern.groupindex else m.group(1)
            try:
                return _finite_step(float(raw))
            except (TypeError, ValueError):
                return None
        if obj is None:
            return None
        step = obj.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return None
        return _finite_step(float(step))


def _json_object(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it holds none."""
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _finite_step(step: float) -> float | None:
    """``step``, or ``None`` (dropped with a log line) if it is NaN or infinite."""
    if math.isfinite(step):
        return step
    log.warning("dropped a progress line with a non-finite step (%r)", step)
    return None


def _finite(metrics: Any) -> Any:
    """``metrics`` with non-finite numbers replaced by ``None`` at any depth (JSON and the broker
    refuse them; one NaN in a per-class list would otherwise cost the report all its metrics)."""
    if isinstance(metrics, float):
        return metrics if math.isfinite(metrics) else None
    if isinstance(metrics, dict):
        return {k: _finite(v) for k, v in metrics.items()}
    if isinstance(metrics, list):
        return [_finite(v) for v in metrics]
    return metrics


def log_excerpt(lines: Iterable[str], *, line_chars: int = 500, total_chars: int = 8000) -> str:
    """The last log ``lines`` as one text fit for a job's reason: each line cut to its last
    ``line_chars`` characters (a progress bar redrawn with ``\r`` and no newline is one line of
    megabytes), NUL characters replaced (no database column takes them), and the whole cut to its
    last ``total_chars`` characters (the broker's API takes a reason of at most 20,000)."""
    kept = [line[-line_chars:].replace("\x00", "\ufffd") for line in lines]
    return "\n".join(kept)[-total_chars:]
