"""Benchmark: GPU-type-aware adaptive vs the type-blind adaptive policy and a Gavel-style peer on mixed clusters.

Workloads are cut from both bundled traces with the project's generator (8-hour arrival windows
starting at hour 0 and hour 12 of the day, loads 0.5 and 1.0, seeds 0-2), their models drawn among
those measured on every type of the cluster, and run on three mixed 16-GPU clusters:

* ``2x4:V100,2x4:K80`` and ``2x4:V100,1x4:P100,1x4:K80`` (Gavel's measurements),
* ``2x4:A100,2x4:T4`` (ElasticFlow's A100 and Pollux's T4 measurements).

Each workload runs under ``adaptive`` (type-aware), ``adaptive-typeblind``
(``AdaptivePolicy(type_aware=False)``) and ``gavel``. Also measured: one type-aware decision at
2,000 jobs on 10,000 GPUs of two types (goal <= 50 ms median).

Writes ``benchmarks/results/heterogeneous.csv`` (one row per run) and
``heterogeneous_summary.json`` (geometric means per cluster, decision time), and prints the tables
``docs/benchmarks.md`` shows.

    python benchmarks/heterogeneous.py [--quick] [--decision-time-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from scheduling import (  # benchmarks/ is on sys.path: a script's own directory
    synthetic_pool,
    timed_decisions,
)

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.state import ClusterState
from airflow_elastic_gpu.simulator import report
from airflow_elastic_gpu.simulator.engine import simulate
from airflow_elastic_gpu.simulator.mixed import MixedCluster, load_typed_profiles
from airflow_elastic_gpu.simulator.profiles import bundled_data
from airflow_elastic_gpu.simulator.trace import load_trace
from airflow_elastic_gpu.simulator.workload import generate_workload

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
TRACES = {"philly": "philly_vc-ee9e8c_2017-10-23_14d.csv", "itp": "itp_cluster02_day27_3d.csv"}
CLUSTERS = ("2x4:V100,2x4:K80", "2x4:A100,2x4:T4", "2x4:V100,1x4:P100,1x4:K80")
POLICIES = ("adaptive", "adaptive-typeblind", "gavel")
console = Console(width=130)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def policy_of(name: str):
    if name == "adaptive-typeblind":
        return AdaptivePolicy(type_aware=False, name=name)
    return name


def decision_time(jobs: int = 2000, nodes: int = 1250, gpus_per_node: int = 8, repeats: int = 11) -> dict:
    """Median wall time (s) of one type-aware adaptive decision on a busy synthetic pool whose nodes
    are half V100, half K80; jobs measured on the type they run on, with a relative-speed hint.

    ``first_decision_median_s``: the first decision over an arbitrary placement (a quarter of the
    jobs move type); ``median_s``: the next one, in steady state (its allocations in place).
    """
    types = ("V100", "K80")
    cluster = synthetic_pool(jobs, nodes, gpus_per_node, types)
    node_states, states = cluster.nodes, cluster.jobs
    policy = AdaptivePolicy()

    first, first_cpu = timed_decisions(policy, cluster, repeats)
    # steady state: the next decision, once the first one's allocations (and types) are in place
    decided = policy.decide(cluster)
    kind = {n.name: n.gpu_type for n in node_states}
    steady = ClusterState(node_states, tuple(
        dataclasses.replace(j, allocation=decided.allocations[j.job_id],
                            throughput_by_type={kind[decided.allocations[j.job_id][0].node]: j.throughput}
                            if decided.allocations[j.job_id] else {})
        for j in states), 1000.0)
    times, cpu = timed_decisions(policy, steady, repeats)
    return {"jobs": jobs, "gpus": nodes * gpus_per_node, "types": list(types),
            "median_s": statistics.median(times), "min_s": min(times), "cpu_median_s": statistics.median(cpu),
            "first_decision_median_s": statistics.median(first),
            "first_decision_cpu_median_s": statistics.median(first_cpu), "goal_s": 0.05,
            "load_average_1m": os.getloadavg()[0]}


def report_decision_time(d: dict) -> None:
    """Print :func:`decision_time`'s figures."""
    console.print(f"type-aware adaptive decision at 2,000 jobs / 10,000 GPUs of two types: "
                  f"{1000 * d['median_s']:.0f} ms steady, {1000 * d['first_decision_median_s']:.0f} ms first "
                  f"(medians of wall time; CPU time {1000 * d['cpu_median_s']:.0f} / "
                  f"{1000 * d['first_decision_cpu_median_s']:.0f} ms; load average {d['load_average_1m']:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one cluster, one window, load 1.0, seed 0 (a smoke run)")
    ap.add_argument("--out", default=None,
                    help=f"folder for the results (default {OUT}; with --quick a new temporary folder, so that a "
                         "smoke run does not overwrite the committed figures)")
    ap.add_argument("--decision-time-only", action="store_true",
                    help="only re-measure the decision time and update heterogeneous_summary.json")
    args = ap.parse_args()
    out = Path(args.out or (tempfile.mkdtemp(prefix=f"{Path(__file__).stem}-quick-") if args.quick else OUT))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "heterogeneous_summary.json"
    if args.decision_time_only:
        summary = json.loads(path.read_text()) if path.exists() else {}
        summary["decision_time"] = decision_time()
        path.write_text(json.dumps(summary, indent=2))
        report_decision_time(summary["decision_time"])
        return 0
    clusters = CLUSTERS[:1] if args.quick else CLUSTERS
    windows = (0.0,) if args.quick else (0.0, 12.0)
    loads = (1.0,) if args.quick else (0.5, 1.0)
    seeds = (0,) if args.quick else (0, 1, 2)
    runs = [(c, t, w, load, seed) for c in clusters for t in TRACES for w in windows for load in loads for seed in seeds]
    rows: list[dict] = []
    with Progress(console=console) as bar:
        task = bar.add_task("mixed-type workloads", total=len(runs) * len(POLICIES))
        for spec, trace_name, start, load, seed in runs:
            cluster = MixedCluster.parse(spec)
            profiles = load_typed_profiles(cluster)
            jobs = generate_workload(load_trace(bundled_data(TRACES[trace_name])), gpus=cluster.capacity, hours=8,
                                     load=load, seed=seed, start_hour=start, profiles=profiles)
            wl = f"{spec}|{trace_name}-h{start:g}-load{load:g}-seed{seed}"
            for policy in POLICIES:
                r = simulate(jobs, cluster, policy_of(policy), profiles=profiles, seed=seed)
                rows.append({"workload": wl, "cluster": spec, "trace": trace_name, "start_hour": start, "load": load,
                             "seed": seed, **r.summary(), "policy": policy})
                bar.advance(task)
    by_wl: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_wl.setdefault(row["workload"], {})[row["policy"]] = row
    for pols in by_wl.values():
        for row in pols.values():
            row["jct_vs_typeblind"] = row["avg_jct_s"] / pols["adaptive-typeblind"]["avg_jct_s"]
            row["makespan_vs_typeblind"] = row["makespan_s"] / pols["adaptive-typeblind"]["makespan_s"]
    report.write_summary(rows, out / "heterogeneous.csv")

    summary: dict = {"clusters": {}}
    table = Table(title="mixed-type clusters: geometric mean over workloads of the ratio to type-blind adaptive")
    for col in ("cluster", "workloads", "policy", "avg JCT / type-blind", "makespan / type-blind",
                "worst avg JCT / type-blind", "lowest avg JCT on"):
        table.add_column(col, justify="left" if col in ("cluster", "policy") else "right")
    for spec in clusters:
        wls = [wl for wl in by_wl if wl.startswith(spec + "|")]
        summary["clusters"][spec] = {}
        for policy in POLICIES:
            jct = [by_wl[wl][policy]["jct_vs_typeblind"] for wl in wls]
            mk = [by_wl[wl][policy]["makespan_vs_typeblind"] for wl in wls]
            wins = sum(by_wl[wl][policy]["avg_jct_s"] <= min(p["avg_jct_s"] for p in by_wl[wl].values()) for wl in wls)
            g = {"jct_vs_typeblind": geomean(jct), "makespan_vs_typeblind": geomean(mk),
                 "worst_jct_vs_typeblind": max(jct), "wins": wins, "workloads": len(wls)}
            summary["clusters"][spec][policy] = g
            table.add_row(spec, str(len(wls)), policy, f"{g['jct_vs_typeblind']:.3f}",
                          f"{g['makespan_vs_typeblind']:.3f}", f"{g['worst_jct_vs_typeblind']:.3f}",
                          f"{wins}/{len(wls)}")
    console.print(table)
    summary["decision_time"] = decision_time()
    report_decision_time(summary["decision_time"])
    path.write_text(json.dumps(summary, indent=2))
    console.print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
