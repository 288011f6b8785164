"""``airflow-elastic-gpu cleanup``: remove the job and checkpoint directories of jobs that ended long
ago (:mod:`airflow_elastic_gpu.backends.local_cleanup`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from airflow_elastic_gpu.backends import local_cleanup
from airflow_elastic_gpu.config import default_work_dir

MAX_DAYS = 36500.0


def _days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of days, got {value!r}") from None
    if not 0 <= days <= MAX_DAYS:  # days in seconds stay finite
        raise argparse.ArgumentTypeError(f"a number of days from 0 to {MAX_DAYS:g}, got {value!r}")
    return days


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / 2**20:,.1f} MiB"


def cmd_cleanup(args: argparse.Namespace) -> int:
    from airflow_elastic_gpu.cli import _broker, _say_where, console, notes

    work_dir = Path(args.work_dir).expanduser() if args.work_dir else default_work_dir()
    _say_where(args, work_dir)
    if args.work_dir and not work_dir.is_dir():  # a mistyped path said "nothing to remove"
        raise FileNotFoundError(f"--work-dir {work_dir} is not a directory")
    found = local_cleanup.leftovers(_broker(args, existing=True), work_dir, args.older_than * 86400.0)
    if not found:
        console.print(f"nothing to remove: no directory under {escape(str(work_dir))} belongs to a job "
                      f"that ended {args.older_than:g} or more days ago")
        return 0
    table = Table(title="would remove" if args.dry_run else "removed")
    for col in ("directory", "what", "job", "status", "ended", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    freed, removed, kept, failed = 0, 0, 0, []
    try:
        for item in found:  # one that fails is said, and the others are tried
            try:
                if not args.dry_run and not local_cleanup.remove(item):
                    kept += 1  # claimed by a new try of its task meanwhile
                    continue
            except OSError as exc:  # a permission, a busy mount point: named with its directory
                failed.append(f"{exc.filename or item.path}: {exc.strerror or exc}")
                continue
            freed += item.size_bytes
            removed += 1
            table.add_row(Text(item.path.name), item.kind, item.job.id[:8], item.job.status.value,
                          f"{item.age_s / 86400:.1f} days ago", _mib(item.size_bytes))
    finally:  # Ctrl-C too: what was removed, and what could not be, is said
        console.print(table)
        verb = "would free" if args.dry_run else "freed"
        console.print(f"{verb} {_mib(freed)} in {removed} directories under {escape(str(work_dir))}"
                      + (f"; {kept} kept: a new try of its task claimed it meanwhile" if kept else ""))
        for line in failed:
            notes.print(f"[red]error:[/red] could not remove {escape(line)}", soft_wrap=True, highlight=False)
    return 1 if failed else 0


def add_cleanup_command(sub: argparse._SubParsersAction) -> None:
    """Add ``cleanup`` to the CLI's subcommands."""
    p = sub.add_parser("cleanup", help="remove the job and checkpoint directories of jobs that ended long ago")
    p.add_argument("--older-than", type=_days, required=True, metavar="DAYS",
                   help="only directories of jobs that ended at least this many days ago (e.g. 14; 0: every "
                        "ended job's); a queued, running or suspended job's are never removed")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--work-dir", default=None,
                   help="the local backend's work directory (default [elastic_gpu] work_dir, else "
                        "$AIRFLOW_HOME/elastic_gpu_jobs)")
    p.set_defaults(fn=cmd_cleanup)
