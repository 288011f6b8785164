"""Benchmark: an in-place resize vs a pod re-creation, with real containers (podman).

Runs ``containers/run_job.py`` (the Kubernetes backend's generated pod under ``podman kube play``,
the broker API on the host; needs ``make images``) ``--runs`` times per mechanism, alternating
them so that the machine's load falls on both alike. Each run resizes its job twice
(2 -> 1 -> 2 GPUs). Measured from the trainer container's log (podman's timestamps):

* ``inplace_s``: the broker publishes a new generation -> the first training step of the trainer
  restarted by the pod's launcher (the agent's poll, SIGTERM, checkpoint, exit, restart, resume);
* ``recreate_s``: the old pod's deletion is called -> the new pod's first training step (its
  containers stopped in the kubelet's order, the SIGTERM checkpoint, the new pod played with the
  images cached, init container, agent, launcher, resume);
* ``recreate_from_publication_s``: publication -> first step in re-creation mode (adds the backend's
  reaction, here at most a 0.5 s poll);
* ``pod_delete_s`` and ``recreate_start_s``: ``recreate_s`` in its two parts, the old pod's
  termination (the simulator's *stop* part, at most the grace period) and the old pod gone -> the
  new pod's first step (its *start* part: scheduling, container start, initialisation);
* ``pod_start_s``: a job's first pod played -> its first step (a cold start in a pod, images cached).

Each figure is the median of every resize (or pod start) of the runs, with min, max and samples.
Results go to ``benchmarks/results/recreate_overhead.json``.

    python benchmarks/recreate_overhead.py [--runs 5] [--total-steps 600]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "containers"))

from run_job import STEP_MS, PodRun, run

RESULTS = REPO / "benchmarks" / "results" / "recreate_overhead.json"
MEANING = {
    "inplace_s": "broker publishes a new generation -> first training step after the in-place restart "
                 "(the same pod; the trainer container's launcher restarts torchrun)",
    "recreate_s": "old pod's deletion called -> the new pod's first training step (images cached)",
    "recreate_from_publication_s": "broker publishes a new generation -> the new pod's first training step",
    "pod_start_s": "a job's first pod played -> its first training step (images cached)",
    "pod_delete_s": "deletion called -> the old pod's containers stopped (SIGTERM, checkpoint) and removed",
    "recreate_start_s": "old pod removed -> the new pod's first training step (recreate_s - pod_delete_s)",
}


def summary(values: list[float]) -> dict:
    """Median, min, max (seconds) and the samples of ``values``."""
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
            "n": len(values), "samples_s": [round(v, 3) for v in values]}


def collect(runs: list[PodRun]) -> dict[str, list[float]]:
    """The samples of each measure over ``runs``.

    :raises RuntimeError: a run did not succeed or a resize's first step is missing from the log.
    """
    samples: dict[str, list[float]] = {k: [] for k in MEANING}
    for result in runs:
        if result.status != "succeeded" or any(r.overhead_s is None for r in result.resizes):
            raise RuntimeError(f"a {result.mechanism} run did not give its figures: {result.to_dict()}")
        if result.mechanism == "inplace":
            samples["inplace_s"] += [r.overhead_s for r in result.resizes]
        else:
            samples["recreate_s"] += [r.overhead_s for r in result.resizes]
            samples["recreate_from_publication_s"] += [r.from_publication_s for r in result.resizes]
            deleted = result.pod_delete_s[:len(result.resizes)]  # the replaced pods, in order
            samples["pod_delete_s"] += deleted
            samples["recreate_start_s"] += [r.overhead_s - d for r, d in zip(result.resizes, deleted, strict=True)]
        if result.first_step_s is not None:
            samples["pod_start_s"].append(result.first_step_s)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per mechanism (each resizes twice)")
    p.add_argument("--total-steps", type=int, default=600)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    console = Console()
    load_before = os.getloadavg()
    runs: list[PodRun] = []
    for i in range(args.runs):
        for mechanism in ("inplace", "recreate"):
            result = run(mechanism, args.total_steps)
            runs.append(result)
            console.print(f"run {i + 1}/{args.runs} {mechanism}: "
                          + ", ".join(f"{r.from_gpus}->{r.to_gpus} {r.overhead_s:.1f} s" for r in result.resizes
                                      if r.overhead_s is not None))
    samples = collect(runs)
    podman = subprocess.run(["podman", "--version"], check=False, capture_output=True, text=True).stdout.strip()
    result = {
        "inplace_s": statistics.median(samples["inplace_s"]),
        "recreate_s": statistics.median(samples["recreate_s"]),
        "runs": args.runs,
        "resizes_per_run": 2,
        "measures": MEANING,
        "stats": {name: summary(values) for name, values in samples.items()},
        "by_direction": {m: {d: statistics.median(r.overhead_s for run_ in runs if run_.mechanism == m
                                                  for r in run_.resizes if f"{r.from_gpus}->{r.to_gpus}" == d)
                             for d in ("2->1", "1->2")} for m in ("inplace", "recreate")},
        "steps_redone": max(r.stopped_step - r.resumed_step for run_ in runs for r in run_.resizes),
        "setup": {"total_steps": args.total_steps, "step_ms": STEP_MS, "gpus": "2 virtual (CPU, gloo)",
                  "container_runtime": f"{podman}, runc, slirp4netns"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"resize overhead with real containers, {args.runs} runs per mechanism, 2 resizes each")
    for col in ("measure", "median", "min", "max", "n"):
        table.add_column(col)
    for name in MEANING:
        s = result["stats"][name]
        table.add_row(name, f"{s['median_s']:.1f} s", f"{s['min_s']:.1f} s", f"{s['max_s']:.1f} s", str(s["n"]))
    console.print(table)
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
