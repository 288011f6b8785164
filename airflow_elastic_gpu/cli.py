"""``airflow-elastic-gpu``: inspect and drive the GPU broker from a terminal (rich tables and progress).

Commands: ``nodes`` (list, ``add``, ``detect``, ``kube-sync``, ``drain``, ``uncordon``, ``remove``),
``pool`` (policy settings), ``cleanup`` (job and checkpoint directories of long-ended jobs),
``jobs``, ``status`` (``--watch`` for a live view), ``cancel``,
``run-local`` (submit a command as a job on this host and follow it),
``workload`` (cut a paper-scale workload from a trace) and ``simulate``
(replay a trace under several policies and compare them).
The broker URL comes from ``--broker-url``, or the Airflow connection ``--conn-id`` names (as tasks
read it: :class:`~airflow_elastic_gpu.hooks.broker.GpuBrokerHook`), else
:func:`~airflow_elastic_gpu.config.default_broker_url` (``$AIRFLOW_ELASTIC_GPU_BROKER_URL``, else a
SQLite file in ``$AIRFLOW_HOME``); ``run-local``, ``jobs`` and ``status`` say on stderr which broker
and job directory they use.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import shlex
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from alembic.runtime.migration import MigrationContext
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.exc import DatabaseError

from airflow_elastic_gpu.backends.base import BackendError, start_job
from airflow_elastic_gpu.broker.db import SchemaError, ensure_schema, sqlite_file
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    BrokerError,
    JobSpec,
    JobView,
    NotFound,
)
from airflow_elastic_gpu.cli_broker import RetryNotice, database_error, from_connection
from airflow_elastic_gpu.cli_cleanup import add_cleanup_command
from airflow_elastic_gpu.cli_nodes import add_nodes_command
from airflow_elastic_gpu.cli_parsing import Parser, absolute_path, positive_s
from airflow_elastic_gpu.cli_serve import add_broker_command
from airflow_elastic_gpu.cli_simulator import add_simulator_commands
from airflow_elastic_gpu.cli_simulator import console as simulator_console
from airflow_elastic_gpu.cli_views import full_width_unless_terminal, jobs_table, snapshot_view
from airflow_elastic_gpu.config import (
    default_broker_url,
    default_pool,
    default_work_dir,
    mask_url,
)
from airflow_elastic_gpu.scheduling.policy import policy_parameters, stored_policy
from airflow_elastic_gpu.states import JobStatus

console = Console()
notes = Console(stderr=True)

CLI_RECONNECT_DEADLINE_S = 10.0
"""A command gives up on an unreachable database after this long (agents and triggers wait longer)."""
STATUS_ENDED_JOBS = 10
"""``status`` lists the active jobs and this many of the latest ended ones (``jobs`` lists every one)."""


def _broker(args: argparse.Namespace, *, existing: bool = False) -> GpuBroker:
    """The broker of ``--broker-url`` (else the configured one).

    :param existing: a command that only reads or changes what is there (``jobs``, ``status``,
        ``cancel``, ``nodes list``, ``cleanup``): a SQLite file that does not exist is an error, not
        a new, empty broker (a mistyped ``$AIRFLOW_HOME`` showed an empty pool and said nothing).
    :raises NotFound: ``existing`` and no such SQLite file.
    """
    url = args.broker_url or default_broker_url()
    if existing and (path := sqlite_file(url)) is not None and not path.exists():
        hint = ("" if os.environ.get("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT") is None or args.conn_id else
                "; the elastic_gpu_default connection in the environment is read by Airflow's tasks, "
                "and by this command with --conn-id elastic_gpu_default")
        raise NotFound(f"no broker database at {path}: nothing has used this broker yet (check "
                       f"$AIRFLOW_HOME, --broker-url, $AIRFLOW_ELASTIC_GPU_BROKER_URL or [elastic_gpu] broker_url"
                       f"{hint})")
    broker = GpuBroker(url, reconnect_deadline_s=CLI_RECONNECT_DEADLINE_S, migrate=not existing)

    def check_schema() -> None:  # a database without the broker's tables is not made one by a command that reads
        with broker.engine.connect() as conn:
            if MigrationContext.configure(conn).get_current_revision() is None:
                raise NotFound(f"no broker database at {mask_url(url)}: it holds no broker schema (nothing has "
                               "used this broker yet, or the URL names another database: check --broker-url, "
                               "$AIRFLOW_ELASTIC_GPU_BROKER_URL or [elastic_gpu] broker_url)")
        ensure_schema(broker.engine)  # a broker of an older version: upgraded

    if existing:
        broker._retrying(check_schema)
    return broker


def _say_where(args: argparse.Namespace, work_dir: Path | None = None) -> None:
    """One dim line on stderr: the broker (password hidden) and the local job directories used."""
    url = mask_url(args.broker_url or default_broker_url())
    notes.print(f"broker {url} · job files in {work_dir or default_work_dir()}", style="dim",
                highlight=False, markup=False, soft_wrap=True)


def _param_value(item: str, key: str, value: str) -> bool | int | float:
    """A policy parameter from the command line: ``true``/``false``, an integer, or a number.

    :raises BrokerError: anything else (the message names the parameter).
    """
    if value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise BrokerError(f"--param {item!r}: the value of {key} must be a finite number, true or false, "
                          f"got {value!r}")
    return number


MIN_LEASE_S = 10.0
MIN_REBALANCE_INTERVAL_S = 1.0
_TOO_SHORT = {
    "--lease-s": "a job's agent reports every second and its launcher stops the trainer after half the lease "
                 "without contact, so a shorter lease stops healthy trainings",
    "--rebalance-interval-s": "the broker would decide again and again with nothing changed",
}


def cmd_pool(args: argparse.Namespace) -> int:
    for option, value, least in (("--lease-s", args.lease_s, MIN_LEASE_S),
                                 ("--rebalance-interval-s", args.rebalance_interval_s, MIN_REBALANCE_INTERVAL_S)):
        if value is not None and value < least:
            raise BrokerError(f"{option} must be at least {least:g} s, got {value:g}: {_TOO_SHORT[option]}")
    # the pool must exist (a change too): no empty SQLite file made where the broker is not
    broker = _broker(args, existing=True)
    changes = bool(args.param) or any(v is not None for v in (args.policy, args.lease_s, args.rebalance_interval_s))
    params: dict[str, Any] = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise BrokerError(f"--param {item!r}: expected NAME=VALUE")
        params[key] = _param_value(item, key, value)
    policy = args.policy
    if params or policy is not None:
        # --param adds to the parameters set before (one call per setting, as the README shows),
        # and naming the pool's own policy again keeps them; another policy starts from its defaults
        current, stored = broker.pool_settings(args.pool)
        if policy is None or policy == current:
            # parameters stored before they were checked against the pool's own policy are dropped
            accepted = policy_parameters(current)
            stale = sorted(k for k in stored if k not in accepted)
            if stale:
                notes.print(f"dropping parameters that policy {current!r} does not take: {', '.join(stale)}",
                            markup=False, highlight=False)
            policy, params = current, {**{k: v for k, v in stored.items() if k in accepted}, **params}
    if changes:
        broker.configure_pool(args.pool, policy=policy, policy_params=params or None,
                              lease_s=args.lease_s, rebalance_interval_s=args.rebalance_interval_s)
    # (a bare `pool` only shows the settings: it changes nothing and asks for no rebalance)
    config = broker.pool_config(args.pool)  # one read of the pool's row
    made = stored_policy(config.policy, config.policy_params)  # with every default filled in
    settings = ", ".join(f"{k}={getattr(made, k)!r}" for k in policy_parameters(config.policy))
    console.print(f"pool {escape(repr(args.pool))}: policy {escape(config.policy)} ({escape(settings)}); "
                  f"lease {config.lease_s:g} s; rebalance every {config.rebalance_interval_s:g} s")
    return 0


def _known_pool(broker: GpuBroker, pool: str | None) -> None:
    """:raises NotFound: ``pool`` is given and the broker has no such pool (naming the known ones)."""
    if pool is not None and pool not in (known := broker.pools()):
        raise NotFound(f"unknown GPU pool {pool!r}; known pools: {', '.join(known) or 'none'}")


def cmd_jobs(args: argparse.Namespace) -> int:
    _say_where(args)
    broker = _broker(args, existing=True)
    _known_pool(broker, args.pool)
    console.print(jobs_table(broker.jobs(args.pool, active_only=args.active)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.interval is not None and not args.watch:
        raise ValueError("--interval goes with --watch (status without it shows the pool once)")
    if args.interval is not None and args.interval < 0.2:  # 1e-7 read the database in a busy loop
        raise ValueError(f"--interval must be at least 0.2 seconds, got {args.interval:g}")
    args.interval = args.interval or 1.0
    _say_where(args)
    broker = _broker(args, existing=True)
    _known_pool(broker, args.pool)
    if not args.watch:
        console.print(snapshot_view(broker.snapshot(args.pool, ended=STATUS_ENDED_JOBS)))
        return 0
    with Live(snapshot_view(broker.snapshot(args.pool, ended=STATUS_ENDED_JOBS)), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(snapshot_view(broker.snapshot(args.pool, ended=STATUS_ENDED_JOBS)))
        except KeyboardInterrupt:
            return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    broker = _broker(args, existing=True)
    before = _job(broker, args.job_id)
    if before.status.terminal:
        console.print(f"job {before.id} had already ended ({before.status.value}): nothing to cancel")
        return 0
    job = broker.cancel(before.id, args.reason)
    console.print(f"job {job.id} is {job.status.value}")
    return 0


def _job(broker: GpuBroker, given: str) -> JobView:
    """The job ``given`` names: its id, or the start of exactly one queued or running job's id
    (``jobs`` and ``status`` show the first 8 characters) that no ended job's id starts with too.

    :raises NotFound: no job has that id and no active job's id starts with it, or several jobs'
        ids do (named: a short prefix picked the running job while the user looked at an ended one).
    """
    if not given:
        raise NotFound("give a job id (jobs lists them)")
    try:
        return broker.job(given)
    except NotFound:
        pass
    everyone = sorted(broker.jobs(id_prefix=given), key=lambda j: (j.status.terminal, j.id))  # active first
    found = [j for j in everyone if not j.status.terminal]
    if len(found) == 1 and len(everyone) == 1:
        return found[0]
    if found:
        matches = [f"{j.id} ({j.status.value})" for j in everyone]
        raise NotFound(f"{len(matches)} jobs' ids start with {given!r}: {', '.join(matches[:5])}"
                       f"{' ...' if len(matches) > 5 else ''}; give more of the id")
    if len(ended := [j.id for j in everyone]) == 1:
        return broker.job(ended[0])  # one job has it: `cancel` of an ended job answers as for its whole id
    if ended:
        raise NotFound(f"no queued or running job's id starts with {given!r}; ended job(s) {', '.join(ended[:5])}"
                       f"{' ...' if len(ended) > 5 else ''} do (an ended job is named by its whole id)")
    raise NotFound(f"unknown job {given!r}: no job has this id and no queued or running job's id starts "
                   "with it (jobs lists the first 8 characters of each id)")


def follow(broker: GpuBroker, job_ids: list[str], poll_s: float = 1.0) -> list[JobView]:
    """Show a progress bar per job (steps, GPUs, generation) until every job has ended."""
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f} steps"),
        TextColumn("{task.fields[gpus]} GPU(s) gen {task.fields[gen]}"), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        views = [broker.job(j) for j in job_ids]
        tasks = [progress.add_task(escape(v.name), total=v.total_steps, gpus=0, gen=0, status="") for v in views]
        while True:
            views = [broker.job(j) for j in job_ids]
            for task, v in zip(tasks, views):
                progress.update(task, completed=v.steps_done, gpus=len(v.in_use_gpus),
                                gen=v.acked_generation, status=v.status.value)
            if all(v.status.terminal for v in views):
                return views
            time.sleep(poll_s)


def job_name_from_command(command: str) -> str:
    """A job name for ``command``: its Python script's stem (``train_digits`` for
    ``python -m torch.distributed.run ... examples/train_digits.py --total-steps 600``), else the module
    run with ``-m`` (``torch.distributed`` launchers aside), else the program's name."""
    words = shlex.split(command)
    for word in words:
        if not word.startswith("-") and Path(word).suffix == ".py":
            return Path(word).stem
    for flag, module in itertools.pairwise(words):
        if flag == "-m" and module not in ("torch.distributed.run", "torch.distributed.launch"):
            return module.rsplit(".", 1)[-1]
    return Path(words[0]).name


def cmd_run_local(args: argparse.Namespace) -> int:
    from airflow_elastic_gpu.backends import make_backend

    work_dir = Path(args.work_dir) if args.work_dir else default_work_dir()
    _say_where(args, work_dir)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise BrokerError("no command given: airflow-elastic-gpu run-local [options] -- CMD ...")
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    broker = _broker(args)
    backend = make_backend("local", broker=broker, work_dir=work_dir, virtual_gpus=args.virtual_gpus,
                           virtual_nodes=args.virtual_nodes)
    registered = backend.ensure_pool(args.pool)
    if registered:
        console.print(registered, markup=False, highlight=False)
    backend.check(cmd, args.checkpoint_dir)  # before submit: a job that cannot start never takes a GPU
    job = broker.submit(JobSpec(
        name=args.name or job_name_from_command(cmd), command=cmd, min_gpus=args.min_gpus,
        max_gpus=args.max_gpus, requested_gpus=args.requested_gpus, total_steps=args.total_steps, pool=args.pool,
        progress_pattern=args.progress_pattern, checkpoint_dir=args.checkpoint_dir, key=args.key,
    ))
    if not job.status.terminal:  # an ended job of the key is shown, not started: it trained
        # a start that fails after all fails a new job, freeing its GPUs; one started before from
        # another work directory is refused (a start here would run a second trainer of it)
        start_job(broker, backend, job)
    if job.token is None:  # the key's job, submitted before (only the reply that creates a job has its token)
        console.print(f"job {job.id} of key {escape(repr(args.key))} was submitted before and is "
                      f"{job.status.value}: not started again; files in {escape(str(work_dir / job.id))}")
    else:
        console.print(f"job {job.id} started; files in {escape(str(work_dir / job.id))}")
    if args.detach:
        return 0
    try:
        [view] = follow(broker, [job.id])
    except KeyboardInterrupt:  # the job's processes are detached: they run on, with their GPUs
        shown = mask_url(args.broker_url or "")  # the broker this command used, quoted for a shell
        where = (f"--conn-id {shlex.quote(args.conn_id)} " if args.conn_id else
                 f"--broker-url {shlex.quote(shown)} " if args.broker_url else "")
        console.print(f"\njob {job.id} goes on without this command (queued, or running on its GPUs); "
                      f"`airflow-elastic-gpu {where}cancel {job.id[:8]}` stops it"
                      + (" (*** the password)" if shown != (args.broker_url or "") else ""), markup=False, highlight=False)
        return 130
    # as the operator does at a job's end: nothing of it left running, and the default checkpoint
    # directory of a success renamed out of the key's way (a later run of the key trains anew)
    backend.stop(job.id, succeeded=view.status is JobStatus.SUCCEEDED)
    console.print(jobs_table([view], title="result"))
    if warning := view.progress_warning():
        notes.print(warning, style="yellow", markup=False, highlight=False, soft_wrap=True)
    if view.status.value != "succeeded":
        console.print(f"[red]job {view.status.value}:[/red] {escape(view.reason or '')}")
        return 1
    return 0


POOL_DEFAULT = f"[elastic_gpu] default_pool in airflow.cfg, else {DEFAULT_POOL!r}"


def _version() -> str:
    try:
        return version("airflow-elastic-gpu")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="airflow-elastic-gpu",
        description="Inspect and drive the GPU broker from a terminal, run a training as an elastic job on "
                    "this host, and simulate scheduling policies on job traces.",
        epilog="The broker database is --broker-url (or the URL of the Airflow connection --conn-id), "
               "else $AIRFLOW_ELASTIC_GPU_BROKER_URL, else "
               "[elastic_gpu] broker_url in airflow.cfg, else "
               "elastic_gpu_broker.db (SQLite) in $AIRFLOW_HOME (~/airflow when unset). "
               "run-local, jobs and status say which database and job directory they use.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--broker-url", default=None,
                        help="broker DB URL (default: $AIRFLOW_ELASTIC_GPU_BROKER_URL, else [elastic_gpu] "
                             "broker_url in airflow.cfg, else a SQLite file under $AIRFLOW_HOME)")
    parser.add_argument("--conn-id", default=None,
                        help="read the broker URL and default pool from this Airflow connection, as tasks do "
                             "(e.g. elastic_gpu_default; needs the airflow extra)")
    parser.set_defaults(connection_pool=None)  # the pool --conn-id's connection names
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    add_nodes_command(sub)

    p = sub.add_parser("pool", help="set a pool's policy and timing")
    p.add_argument("--pool", default=None, help=f"the pool to configure (default {POOL_DEFAULT})")
    p.add_argument("--policy", default=None,
                   help="adaptive (a new pool's), static, termination or optimus; the simulator's preemptive "
                        "peers (tiresias, afs_l, gavel) are refused")
    p.add_argument("--param", action="append",
                   help="policy parameter NAME=VALUE (a number, true or false), e.g. hysteresis=2 or "
                        "suspend=true; added to those set before (a new --policy starts from its defaults)")
    p.add_argument("--lease-s", type=float, default=None,
                   help="seconds without a heartbeat after which a job is lost and its GPUs reclaimed "
                        "(a new pool: 60)")
    p.add_argument("--rebalance-interval-s", type=float, default=None,
                   help="seconds between two decisions besides those a change asks for (a new pool: 10)")
    p.set_defaults(fn=cmd_pool)

    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--pool", default=None, help="only this pool's jobs (default: every pool)")
    p.add_argument("--active", action="store_true", help="only queued and running jobs")
    p.set_defaults(fn=cmd_jobs)

    p = sub.add_parser("status", help="the pool: GPU grid, jobs, latest events")
    p.add_argument("--pool", default=None, help=f"the pool to show (default {POOL_DEFAULT})")
    p.add_argument("--watch", action="store_true", help="refresh live until Ctrl-C")
    p.add_argument("--interval", type=positive_s, default=None,
                   help="seconds between refreshes with --watch (default 1, at least 0.2)")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("cancel", help="cancel a job and release its GPUs")
    p.add_argument("job_id", help="the job's id, or the start of it that jobs and status show")
    p.add_argument("--reason", default="cancelled from the CLI", help="recorded with the job's end")
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser("run-local", help="run a command as an elastic job on this host and follow it")
    p.add_argument("--name", default=None,
                   help="job name shown by jobs, status and the UI (default: the training script's name)")
    p.add_argument("--min-gpus", type=int, default=1, help="fewest GPUs the job runs on (default 1)")
    p.add_argument("--max-gpus", type=int, default=None,
                   help="most GPUs the broker may give the job (default: --min-gpus)")
    p.add_argument("--requested-gpus", type=int, default=None,
                   help="the GPUs the job would ask a static scheduler for: before it is measured on a whole "
                        "node it spreads over no more nodes than these need (default --max-gpus)")
    p.add_argument("--total-steps", type=int, required=True,
                   help="training steps of the whole job, to predict its remaining time")
    p.add_argument("--pool", default=None, help=f"GPU pool to run in (default {POOL_DEFAULT})")
    p.add_argument("--progress-pattern", default=None,
                   help="regex with a group (?P<step>...) that finds the step in the trainer's output "
                        "(default: JSON lines with a \"step\" key)")
    p.add_argument("--checkpoint-dir", default=None, type=absolute_path,
                   help="the trainer's checkpoint directory, $ELASTIC_CHECKPOINT_DIR (default: "
                        "checkpoints/<key>-<hash>/ in the work directory, shared by the runs of one --key "
                        "until one succeeds)")
    p.add_argument("--key", default=None,
                   help="idempotency key: while a job of this key is queued or running, submitting it "
                        "again returns that job; once it has ended, a new job starts (and resumes from the "
                        "key's default checkpoint directory unless the last job succeeded)")
    p.add_argument("--virtual-gpus", type=int, default=None,
                   help="size of the pool of virtual GPUs made when this host has no NVIDIA GPU "
                        "and the pool no node (default $AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS, else 4), per node; "
                        "a pool that exists keeps its nodes")
    p.add_argument("--virtual-nodes", type=int, default=1,
                   help="split the virtual GPUs into this many nodes of --virtual-gpus each (default 1; "
                        "only when the pool is made, a pool that exists keeps its nodes); a job larger "
                        "than a node then runs on several, one launcher per node (its command uses "
                        "{nnodes} {node_rank} {master_addr} {master_port})")
    p.add_argument("--work-dir", default=None,
                   help="parent of the job directories (default: $AIRFLOW_ELASTIC_GPU_WORK_DIR, else "
                        "elastic_gpu_jobs in $AIRFLOW_HOME or ~/airflow)")
    p.add_argument("--detach", action="store_true", help="start the job and return instead of following it")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command after --; {num_gpus} is replaced by the GPU count at each "
                        "(re)start")
    p.set_defaults(fn=cmd_run_local)

    add_broker_command(sub)
    add_simulator_commands(sub)
    add_cleanup_command(sub)
    parser.share_options_with_subcommands()
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    full_width_unless_terminal(console, notes, simulator_console)
    if args.cmd == "broker":  # a server: its broker retries for longer, and logs as servers do
        return _run(args)
    retries = logging.getLogger("airflow_elastic_gpu.broker.transactions")
    notice, level = RetryNotice(notes, CLI_RECONNECT_DEADLINE_S), retries.level
    retries.addHandler(notice)
    retries.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        return _run(args)
    finally:
        retries.removeHandler(notice)
        retries.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.conn_id is not None:
            from_connection(args)
        if args.cmd in ("pool", "status", "run-local") and args.pool is None:
            args.pool = args.connection_pool or default_pool()
        return args.fn(args)
    except (BrokerError, BackendError, ValueError) as exc:
        notes.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except DatabaseError as exc:  # one line, not a traceback
        url = getattr(args, "broker_url", None) or default_broker_url()
        notes.print(f"[red]error:[/red] {escape(database_error(exc, url, getattr(args, 'conn_id', None)))}",
                    soft_wrap=True, highlight=False)
        return 2
    except (OSError, SchemaError) as exc:  # a file the command cannot make or read, a database of
        # another version or application: one line
        notes.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        notes.print("interrupted", highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
