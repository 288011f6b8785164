"""Files a simulation leaves behind: per-job CSV, summary CSV/JSON, and PNG plots (matplotlib)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow_elastic_gpu.simulator.results import SimulationResult

JOB_COLUMNS = (
    "job_id", "model", "submit_s", "requested_gpus", "duration_s", "work", "start_s", "end_s",
    "jct_s", "queueing_s", "gpu_s", "resizes", "preemptions", "restart_lost_s",
    "restart_lost_gpu_s", "lower_bound_jct_s", "recreate_wait_s", "slowdown", "contention", "ftf_rho",
)


def write_jobs_csv(result: SimulationResult, path: str | Path) -> Path:
    """One row per job (columns :data:`JOB_COLUMNS`; seconds, work in samples; slowdown, contention
    and finish-time fairness rho as defined in :mod:`~airflow_elastic_gpu.simulator.results`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(JOB_COLUMNS)
        for j, (n, rho) in zip(result.jobs, result.fairness()):
            w.writerow([
                j.job_id, j.model, f"{j.submit_s:g}", j.requested_gpus, f"{j.duration_s:g}",
                f"{j.work:.1f}", f"{j.start_s:.1f}", f"{j.end_s:.1f}", f"{j.jct_s:.1f}",
                f"{j.queueing_s:.1f}", f"{j.gpu_s:.1f}", j.resizes, j.preemptions,
                f"{j.restart_lost_s:.1f}", f"{j.restart_lost_gpu_s:.1f}", f"{j.lower_bound_jct_s:.1f}",
                f"{j.recreate_wait_s:.1f}", f"{j.slowdown:.3f}", f"{n:.3f}", f"{rho:.3f}",
            ])
    return path


def write_summary(summaries: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Summaries as CSV (``.csv``) or JSON (any other suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        keys = list(dict.fromkeys(k for s in summaries for k in s))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for s in summaries:
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in s.items()})
    else:
        path.write_text(json.dumps(list(summaries), indent=2))
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _few_log_labels(axis) -> None:
    """Label a log axis at 1, 2 and 5 times the powers of ten, as plain numbers (0.5, 2, 10), and no
    minor tick: matplotlib's default labels minor ticks when the axis spans less than a decade or
    two, and those labels overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_jct_cdf(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> Path:
    """CDF of JCT (hours, log x) per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        jct = sorted(j.jct_s / 3600 for j in r.jobs)
        ax.step(jct, [(i + 1) / len(jct) for i in range(len(jct))], where="post", label=r.policy)
    ax.set_xscale("log")
    _few_log_labels(ax.xaxis)
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title or "JCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_gpus_in_use(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> Path:
    """GPUs held over time (hours from the first submit) per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        t0 = r.busy[0][0]
        ax.step([(t - t0) / 3600 for t, _ in r.busy], [n for _, n in r.busy], where="post", label=r.policy)
    if results:
        ax.axhline(results[0].cluster.capacity, color="grey", ls="--", lw=1, label="capacity")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPUs allocated")
    ax.set_title(title or "GPUs in use")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_allocation_timeline(result: SimulationResult, path: str | Path, max_jobs: int = 40) -> Path:
    """Per-job GPU count over time for one policy (one row per job, colour = GPUs held)."""
    plt = _pyplot()
    from matplotlib import cm, colors

    jobs = sorted(result.jobs, key=lambda j: (j.submit_s, j.job_id))[:max_jobs]
    index = {j.job_id: i for i, j in enumerate(jobs)}
    t0 = min(j.submit_s for j in result.jobs)
    cap = result.cluster.capacity
    norm = colors.Normalize(vmin=1, vmax=max(2, cap))
    cmap = cm.get_cmap("viridis") if hasattr(cm, "get_cmap") else plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.22 * len(jobs) + 1)))
    current: dict[str, tuple[float, int]] = {}
    for t, job_id, n in [*result.allocations, (math.inf, "", 0)]:
        if job_id and job_id not in index:
            continue
        ends = [job_id] if job_id else list(current)
        for jid in ends:
            if jid in current:
                start, held = current.pop(jid)
                end = t if math.isfinite(t) else start
                if held > 0 and end > start:
                    ax.barh(index[jid], (end - start) / 3600, left=(start - t0) / 3600,
                            color=cmap(norm(held)), height=0.8)
        if job_id:
            current[job_id] = (t, n)
    for j in jobs:
        ax.plot([(j.submit_s - t0) / 3600], [index[j.job_id]], marker="|", color="black", ms=6)
    ax.set_yticks(range(len(jobs)), [j.job_id for j in jobs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (hours); | = submit")
    ax.set_ylabel("job")
    ax.set_title(f"{result.policy}: GPUs per job over time")
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label="GPUs held")
    return _save(plt, fig, path)
