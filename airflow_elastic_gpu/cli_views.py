"""What the CLI and the demos print of the broker: the jobs table and the pool's live view (rich).

Kept apart from the command-line parsing and the commands (:mod:`airflow_elastic_gpu.cli`) so that the
demos draw the same views without the CLI.
"""

from __future__ import annotations

import shlex
import time

from rich.cells import cell_len
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from airflow_elastic_gpu.broker.types import JobView, PoolSnapshot

UNWRAPPED_WIDTH = 1000
"""Columns given to rich when output goes to a file or a pipe: tables at their natural width, never cut
to the 80 columns rich assumes when it cannot ask a terminal."""


def full_width_unless_terminal(*consoles: Console) -> None:
    """Give each console that does not write to a terminal :data:`UNWRAPPED_WIDTH` columns."""
    for c in consoles:
        if not c.is_terminal:
            c.width = UNWRAPPED_WIDTH


def _plain(text: str) -> Text:
    """A table cell of text from users or trainers (job and node names, event messages): shown as
    it is, never read as rich markup (``[rank0]`` is not a tag)."""
    return Text(text)


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.1f}"


def metric_text(value: object) -> Text:
    """A metric for a table cell: a number to 3 decimals, anything else (a trainer may print a
    string, a list) as its text, at most 20 characters; ``-`` for none. A :class:`~rich.text.Text`,
    never read as markup: a trainer's ``"[/x]"`` made rich raise ``MarkupError`` at every ``jobs``."""
    if value is None:
        return Text("-")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Text(f"{value:.3f}")
    text = str(value)
    return _plain(text if len(text) <= 20 else text[:19] + "…")


def jobs_table(jobs: list[JobView] | tuple[JobView, ...], title: str = "jobs") -> Table:
    table = Table(title=title)
    for col in ("job", "name", "status", "GPUs", "min-max", "step", "gen", "resizes", "JCT s",
                "GPU-s", "accuracy"):
        table.add_column(col, justify="right" if col not in ("job", "name", "status") else "left")
    for j in jobs:
        acc = (j.metrics or {}).get("accuracy")
        table.add_row(
            j.id[:8], _plain(j.name), j.status.value, str(len(j.in_use_gpus or j.target_gpus)),
            f"{j.min_gpus}-{j.max_gpus}", f"{j.steps_done:,.0f}/{j.total_steps:,}",
            f"{j.acked_generation}/{j.target_generation}", str(j.num_resizes), _fmt_s(j.jct_s),
            f"{j.gpu_seconds:,.0f}", metric_text(acc),
        )
    return table


def snapshot_view(snap: PoolSnapshot) -> Group:
    """The pool as a GPU grid (which job holds which GPU), the jobs, and the latest events."""
    names = {j.id: j.name for j in snap.jobs}
    title = f"GPU pool {snap.pool!r}"
    # a pool of few or narrow columns would wrap its title over several lines
    grid = Table(title=Text(title), min_width=cell_len(title) + 4)
    grid.add_column("node")
    width = max((len(n.gpus) for n in snap.nodes), default=0)
    # columns are positions: named by device index where every node's GPUs are 0, 1, ...; else each
    # cell names its GPU (a host split into virtual nodes: localhost-1 has GPUs 2 and 3)
    by_position = all([g.gpu.index for g in n.gpus] == list(range(len(n.gpus))) for n in snap.nodes)
    for i in range(width):
        grid.add_column(f"GPU {i}" if by_position else "")
    for node in snap.nodes:
        cells = []
        for g in node.gpus:
            holder = g.in_use_by or g.target_of
            label = Text(names.get(holder, "")) if holder else Text("free", style="dim")
            if g.target_of and g.target_of != g.in_use_by:
                label.append(" (→)", style="yellow")
            if not g.healthy:  # out of service: its job (if any) is being moved off it
                label = Text("out of service", style="red") if not holder else label + Text(" (out of service)", style="red")
            cells.append(label if by_position else Text(f"{g.gpu.index}: ", style="bold") + label)
        grid.add_row(Text(node.name) + ("" if node.schedulable else Text(" (drained)", style="red")), *cells)
    if not snap.nodes:
        pool = f" --pool {shlex.quote(snap.pool)}"
        grid.add_row(Text(f"none: `airflow-elastic-gpu nodes add NAME --gpus N{pool}`, `nodes detect{pool}` or "
                          f"`nodes kube-sync{pool}` registers them", style="dim"))
    events = Table(title="latest events")
    events.add_column("time")
    events.add_column("job")
    events.add_column("event")
    events.add_column("message", overflow="fold")
    for e in snap.events[-10:]:
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e.time_s)),
                       _plain(names.get(e.job_id or "", "")), e.kind, _plain(e.message))
    jobs = jobs_table(list(snap.jobs))
    if snap.ended_hidden:
        jobs.caption = f"and {snap.ended_hidden} older ended jobs (`airflow-elastic-gpu jobs` lists every one)"
    return Group(grid, jobs, events)
