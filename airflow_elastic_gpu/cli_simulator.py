"""The simulator's commands of ``airflow-elastic-gpu``: ``workload`` (cut a paper-scale workload from
a trace) and ``simulate`` (replay a trace under several policies and compare them, with the tail and
finish-time fairness; ``docs/simulator.md``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()


def cmd_workload(args: argparse.Namespace) -> int:
    from airflow_elastic_gpu.simulator.mixed import MixedCluster, load_typed_profiles, parse_cluster
    from airflow_elastic_gpu.simulator.profiles import load_profiles
    from airflow_elastic_gpu.simulator.trace import load_trace, write_trace
    from airflow_elastic_gpu.simulator.workload import generate_workload

    cluster = parse_cluster(args.cluster) if args.cluster else None
    if isinstance(cluster, MixedCluster):  # models drawn among those measured on every type
        profiles: Any = load_typed_profiles(cluster, args.profiles)
    else:
        profiles = load_profiles(args.profiles, args.profile_source)
    gpus = args.gpus if args.gpus is not None else cluster.capacity if cluster is not None else 16
    jobs = generate_workload(
        load_trace(args.trace), gpus=gpus, hours=args.hours, load=args.load, seed=args.seed,
        start_hour=args.start_hour, max_gpu_hours=args.max_gpu_hours, profiles=profiles,
    )
    write_trace(args.out, jobs)
    gpu_h = sum(j.gpu_time_s for j in jobs) / 3600
    console.print(f"wrote {len(jobs)} jobs ({gpu_h:.1f} GPU-hours) to {args.out}", markup=False, highlight=False)
    return 0


RECREATE_OPTIONS = ("grace_period_s", "scheduling_s", "image_size_mb", "pull_bandwidth_mb_s",
                    "container_start_s", "init_s")


def comparison_table(summaries: list[dict[str, Any]], baseline: str = "static") -> Table:
    """Rich table of simulation summaries, with avg-JCT and makespan ratios to ``baseline``: averages,
    the tail (p99 JCT, largest slowdown) and finish-time fairness (largest rho, share of jobs with
    rho > 1); ``docs/simulator.md`` defines each."""
    base = next((s for s in summaries if s["policy"] == baseline), None)
    table = Table(
        title="policies compared" + (f" (x: ratio to {baseline}; LB: lower bound; slow: slowdown; "
                                     "rho: finish-time fairness)" if base else ""),
        caption="static: the Kubernetes default scheduler (each job on its request until it ends)"
        if any(s["policy"] == "static" for s in summaries) else None,
    )
    for col in ("policy", "JCT h", "p99 h", "mksp h", "queue h", "util", "resizes",
                "JCT/LB", "max slow", "max rho", "rho>1", "JCT x", "mksp x"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)

    def hours(value: float) -> str:
        return f"{value / 3600:.2f}"

    for s in summaries:
        ratio = (lambda k, s=s: f"{s[k] / base[k]:.2f}") if base else (lambda k: "-")
        table.add_row(
            s["policy"], hours(s["avg_jct_s"]), hours(s["p99_jct_s"]), hours(s["makespan_s"]),
            hours(s["avg_queueing_s"]), f"{s['gpu_utilisation']:.0%}", str(s["resizes"] + s["preemptions"]),
            f"{s['avg_jct_over_bound']:.2f}", f"{s['max_slowdown']:.1f}", f"{s['max_ftf_rho']:.2f}",
            f"{s['share_ftf_rho_above_1']:.0%}", ratio("avg_jct_s"), ratio("makespan_s"),
        )
    return table


def _restart_overheads(args: argparse.Namespace) -> Any:
    """The simulator's :class:`RestartOverheads` from ``simulate``'s options (unset: the defaults)."""
    from airflow_elastic_gpu.simulator.model import RecreateModel, RestartOverheads

    parts = {name: getattr(args, name) for name in RECREATE_OPTIONS if getattr(args, name) is not None}
    if args.image_uncached:
        parts["image_cached"] = False
    defaults = RestartOverheads()
    return RestartOverheads(
        args.inplace_overhead_s if args.inplace_overhead_s is not None else defaults.inplace_s,
        args.recreate_overhead_s,
        RecreateModel(**parts),
        args.inplace_stop_s if args.inplace_stop_s is not None else defaults.inplace_stop_s,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from airflow_elastic_gpu.simulator import report
    from airflow_elastic_gpu.simulator.engine import simulate
    from airflow_elastic_gpu.simulator.mixed import MixedCluster, load_typed_profiles, parse_cluster
    from airflow_elastic_gpu.simulator.profiles import load_profiles
    from airflow_elastic_gpu.simulator.trace import load_trace

    names = _policy_names(args)  # before minutes of simulation, not after
    trace = load_trace(args.trace)
    cluster = parse_cluster(args.cluster)
    profiles = (load_typed_profiles(cluster, args.profiles) if isinstance(cluster, MixedCluster)
                else load_profiles(args.profiles, args.profile_source))
    overheads = _restart_overheads(args)
    out = _output_directory(args.out) if args.out else None  # made now: a bad --out fails before the work
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=console) as bar:
        for name in names:
            task = bar.add_task(f"{name:<12}", total=1.0)
            results.append(simulate(
                trace, cluster, name, profiles=profiles, overheads=overheads, mechanism=args.mechanism,
                rebalance_interval_s=args.rebalance_interval_s, seed=args.seed,
                progress=lambda f, task=task: bar.update(task, completed=f),
            ))
            bar.update(task, completed=1.0)
    summaries = [r.summary() for r in results]
    Console(width=max(console.width, 110)).print(comparison_table(summaries))
    if out is not None:
        for r in results:
            report.write_jobs_csv(r, out / f"jobs_{r.policy}.csv")
        report.write_summary(summaries, out / "summary.csv")
        report.plot_jct_cdf(results, out / "jct_cdf.png", f"JCT CDF: {Path(args.trace).name} on {cluster}")
        report.plot_gpus_in_use(results, out / "gpus_in_use.png", f"GPUs in use on {cluster}")
        focus = next((r for r in results if r.policy == (args.timeline_policy or "adaptive")), results[0])
        report.plot_allocation_timeline(focus, out / f"timeline_{focus.policy}.png")
        console.print(f"per-job CSVs, summary.csv and plots written to {out}", markup=False, highlight=False)
    return 0


def _output_directory(path: str) -> Path:
    """``simulate --out``, made (with its parents) before the simulation runs.

    :raises ValueError: it cannot be made (a file in its way, no permission) or written into.
    """
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create the directory ({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return out


def _policy_names(args: argparse.Namespace) -> list[str]:
    """``--policy``'s names, each checked before any simulation runs (and ``--timeline-policy``
    among them when plots are written).

    :raises ValueError: no name, an unknown one (the known ones listed), or a timeline policy not run.
    """
    from airflow_elastic_gpu.scheduling.policy import get_policy

    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--policy names no policy: {args.policy!r}")
    for name in names:
        get_policy(name)
    if args.out and args.timeline_policy is not None and args.timeline_policy not in names:
        raise ValueError(f"--timeline-policy {args.timeline_policy!r} is not among --policy {','.join(names)}")
    return names


def add_simulator_commands(sub: Any) -> None:
    """Add ``workload`` and ``simulate`` to the CLI's sub-parsers ``sub``."""
    from airflow_elastic_gpu.simulator.model import RecreateModel, RestartOverheads
    from airflow_elastic_gpu.simulator.profiles import DEFAULT_SOURCE

    overheads, model = RestartOverheads(), RecreateModel()

    p = sub.add_parser("workload", help="cut a paper-scale workload from a raw job trace")
    p.add_argument("--trace", required=True, help="trace CSV (job_id, submit_time_s, num_gpus, duration_s)")
    p.add_argument("--gpus", type=int, default=None,
                   help="cluster size; larger jobs are dropped (default: --cluster's GPUs, else 16)")
    p.add_argument("--cluster", default=None,
                   help="the cluster it is for, as simulate's --cluster; groups of GPU types (e.g. "
                        "2x4:A100,2x4:T4) draw its models among those measured on every type")
    p.add_argument("--hours", type=float, default=8.0, help="arrival window length, at most 24 (default 8)")
    p.add_argument("--load", type=float, default=1.0,
                   help="GPU-time offered, as a multiple of gpus x hours (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of jobs and models (default 0)")
    p.add_argument("--start-hour", type=float, default=0.0,
                   help="window start, hour of the trace's day (default 0)")
    p.add_argument("--max-gpu-hours", type=float, default=None, help="largest job kept (default gpus*hours/8)")
    p.add_argument("--profiles", default=None, help="throughput profile CSV (default: bundled)")
    p.add_argument("--profile-source", default=DEFAULT_SOURCE,
                   help=f"which measurements of the profile CSV to use (default {DEFAULT_SOURCE!r})")
    p.add_argument("--out", required=True, help="output trace CSV")
    p.set_defaults(fn=cmd_workload)

    p = sub.add_parser("simulate", help="replay a trace under several policies and compare them")
    p.add_argument("--trace", required=True,
                   help="workload CSV (job_id, submit_time_s, num_gpus, duration_s[, model]), e.g. from workload")
    p.add_argument("--cluster", default="4x4",
                   help="NODESxGPUS_PER_NODE (default 4x4), or groups of GPU types, e.g. 2x4:V100,2x4:K80 "
                        "(each type's measured profiles; the trace's durations are on the first type; "
                        "its models must be measured on every type: cut it with workload --cluster)")
    p.add_argument("--policy", default="adaptive,static",
                   help="comma-separated (default adaptive,static): adaptive, static (the Kubernetes "
                        "default), termination, tiresias, optimus, afs_l, gavel (mixed types)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model draw for jobs without one (default 0)")
    p.add_argument("--out", default=None, help="directory for per-job CSVs, summary.csv and PNG plots")
    p.add_argument("--mechanism", choices=["inplace", "recreate"], default=None,
                   help="force one resize mechanism for every policy (default: each policy's own)")
    p.add_argument("--inplace-overhead-s", type=float, default=None,
                   help="seconds a resize costs a job restarted in place, in its pod "
                        f"(default {overheads.inplace_s:g})")
    p.add_argument("--inplace-stop-s", type=float, default=None,
                   help="of an in-place resize's cost, the first part: the trainer stops (checkpoint, "
                        "exit) on its old GPUs, which go to others only after it "
                        f"(default {overheads.inplace_stop_s:g}, the measured stop of the trainer)")
    p.add_argument("--recreate-overhead-s", type=float, default=None,
                   help="seconds a resize costs a job whose pod is re-created, in all: overrides the "
                        "parts below (the grace period, at most, is spent on the old GPUs; default "
                        f"their sum, {overheads.of('recreate'):g})")
    p.add_argument("--grace-period-s", type=float, default=None,
                   help="re-creation: the old pod keeps its GPUs this long, not training "
                        f"(default {model.grace_period_s:g}, the measured pod termination; Kubernetes' "
                        "terminationGracePeriodSeconds, 30 s by default, only bounds it)")
    p.add_argument("--pod-scheduling-s", dest="scheduling_s", type=float, default=None,
                   help=f"re-creation: binding the new pod once GPUs are free (default {model.scheduling_s:g})")
    p.add_argument("--image-uncached", action="store_true",
                   help="re-creation: the node pulls the trainer image (default: it is cached)")
    p.add_argument("--image-size-mb", type=float, default=None,
                   help=f"trainer image size, MB (default {model.image_size_mb:.0f}, the project's trainer image)")
    p.add_argument("--pull-bandwidth-mb-s", type=float, default=None,
                   help=f"registry to node, MB/s (default {model.pull_bandwidth_mb_s:g}, a 1 Gbit/s link)")
    p.add_argument("--container-start-s", type=float, default=None,
                   help=f"re-creation: container creation and start (default {model.container_start_s:g}, measured)")
    p.add_argument("--trainer-init-s", dest="init_s", type=float, default=None,
                   help="re-creation: the trainer's start-up to its first step "
                        f"(default {model.init_s:g}, the measured cold start)")
    p.add_argument("--rebalance-interval-s", type=float, default=60.0,
                   help="seconds between two scheduling decisions besides those on arrivals and ends "
                        "(default 60)")
    p.add_argument("--profiles", default=None, help="throughput profile CSV (default: bundled)")
    p.add_argument("--profile-source", default=DEFAULT_SOURCE,
                   help=f"which measurements of the profile CSV to use (default {DEFAULT_SOURCE!r})")
    p.add_argument("--timeline-policy", default=None,
                   help="policy whose per-job timeline is plotted with --out, one of --policy (default: "
                        "adaptive if it runs, else the first)")
    p.set_defaults(fn=cmd_simulate)
