"""Benchmark: what limits the adaptive policy's average JCT, one cause taken away at a time.

On the generated 16-GPU workloads of ``benchmarks/scheduling.py`` (the 12 and the 12 held out),
the adaptive policy runs with each of these taken away, alone and together:

* **restart cost**: every resize is free (in-place restart overhead 0 s instead of the
  measured default), so the hysteresis never holds a resize back;
* **throughput learning**: the policy knows every job's true throughput at every GPU count from
  its submission (``simulate(..., known_throughput=True)``), instead of a prior until the job's
  progress is measured on a count;
* **the minimum a running job keeps**: every job is preemptible and the pool allows suspension,
  so a running job may go back to the queue for better-ranked jobs (what a re-created pod of the
  termination baseline does at each resize);
* **admission order**: the default ``admission_by_gain`` (measured jobs start shortest first,
  when their start gains more than a running job's growth) against ``admission_by_gain=False``
  (every waiting job admitted at its minimum first), once with the three causes above taken away
  and once alone.

Each row is the geometric mean over workloads of avg JCT / static's avg JCT (static run here
too, so the ratios do not depend on another file). What is left with every cause taken away is
the allocation rule's own limit on these workloads.

Writes ``benchmarks/results/policy_ablation.json`` and prints the table that
``docs/benchmarks.md`` shows.

    python benchmarks/policy_ablation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from scheduling import (  # benchmarks/ is on sys.path: a script's own directory
    OUT,
    generated_workloads,
)

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.simulator.engine import ClusterShape, RestartOverheads, simulate

console = Console(width=130)
FREE = RestartOverheads(inplace_s=0.0, recreate_s=0.0)  # no restart, in place or of a pod made on another node
# name -> (policy, simulate keywords)
VARIANTS: dict[str, tuple[AdaptivePolicy | str, dict]] = {
    "static": ("static", {}),
    "adaptive": (AdaptivePolicy(), {}),
    "no restart cost": (AdaptivePolicy(), {"overheads": FREE}),
    "known throughput": (AdaptivePolicy(), {"known_throughput": True}),
    "both": (AdaptivePolicy(), {"overheads": FREE, "known_throughput": True}),
    "both + suspension": (AdaptivePolicy(suspend=True), {"overheads": FREE, "known_throughput": True,
                                                         "preemptible": True}),
    "both + suspension, every job admitted first": (
        AdaptivePolicy(suspend=True, admission_by_gain=False),
        {"overheads": FREE, "known_throughput": True, "preemptible": True}),
    "adaptive, every job admitted first": (AdaptivePolicy(admission_by_gain=False), {}),
}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, load 1.0 (a smoke run)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = list(generated_workloads(args.quick, held_out=True))
    cluster = ClusterShape(4, 4)
    per: dict[str, dict[str, dict]] = {name: {} for name in VARIANTS}  # variant -> workload -> figures
    t0 = time.perf_counter()
    with Progress(console=console) as bar:
        task = bar.add_task("ablations", total=len(runs) * len(VARIANTS))
        for wl, _trace, _load, seed, _hour, jobs in runs:
            for name, (policy, kw) in VARIANTS.items():
                s = simulate(jobs, cluster, policy, seed=seed, **kw).summary()
                per[name][wl] = {k: s[k] for k in ("avg_jct_s", "makespan_s", "p99_jct_s")}
                bar.advance(task)
    static = per["static"]
    sets = {"generated": [wl for wl, *_ in runs if "-from" not in wl],
            "held out": [wl for wl, *_ in runs if "-from" in wl]}
    summary: dict = {"workloads": {k: len(v) for k, v in sets.items()}, "variants": {}}
    table = Table(title="Adaptive policy, one cause taken away at a time (geomean ratio to static)")
    table.add_column("variant")
    for label in sets:
        table.add_column(f"avg JCT, {label}", justify="right")
        table.add_column(f"makespan, {label}", justify="right")
    for name in VARIANTS:
        if name == "static":
            continue
        row = {}
        for label, wls in sets.items():
            if not wls:
                continue
            row[label] = {
                "avg_jct_vs_static": geomean([per[name][w]["avg_jct_s"] / static[w]["avg_jct_s"] for w in wls]),
                "makespan_vs_static": geomean([per[name][w]["makespan_s"] / static[w]["makespan_s"] for w in wls]),
            }
        summary["variants"][name] = row
        table.add_row(name, *[f"{row[label][k]:.3f}" if label in row else "-"
                              for label in sets for k in ("avg_jct_vs_static", "makespan_vs_static")])
    summary["per_workload"] = per
    summary["wall_s"] = time.perf_counter() - t0
    (out / "policy_ablation.json").write_text(json.dumps(summary, indent=2))
    console.print(table)
    console.print(f"wrote {out / 'policy_ablation.json'} in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
