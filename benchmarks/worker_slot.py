"""Benchmark: worker-slot time a training task costs, started from a worker vs from the triggerer.

A deferrable ``ElasticTrainingOperator`` takes a worker slot twice: to start (``execute``: broker
client, pool check, submit, start the job's processes, then ``TaskDeferred``) and to finish
(``execute_complete``: read the job and its events, return the metrics). With
``start_from_trigger=True`` the first phase runs in the triggerer (``ElasticTrainingTrigger._submit``,
in a thread) and the worker only runs ``execute_complete``.

Each phase is timed in this process with a fresh operator (a new hook and broker client, as in a
new task process), a SQLite broker and the local backend starting real agent and launcher
processes, on a job of a stand-in trainer (a few JSON progress lines). The medians of ``--runs``
runs (default 5) go to ``benchmarks/results/worker_slot.json``. Not included: the task runner's own
start-up per worker phase (process start, DAG parse, API calls), which is the same for every
operator; ``start_from_trigger`` saves one of those too.

    python benchmarks/worker_slot.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results" / "worker_slot.json"
TRAINER = """
import json, sys, time
for step in range(1, 6):
    time.sleep(0.05)
    print(json.dumps({"step": step}), flush=True)
print(json.dumps({"final": True, "step": 5, "accuracy": 0.95}), flush=True)
"""


class _TI:
    """The task-instance fields the operator and the trigger read (no metadata DB needed)."""

    dag_id, task_id, try_number = "bench", "train", 1

    def __init__(self, run: int) -> None:
        self.run_id, self.map_index = f"manual__{run}", -1
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def _wait_terminal(broker, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not broker.job(job_id).status.terminal:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not end within {timeout_s} s")
        time.sleep(0.1)


def run(runs: int) -> dict:
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.compat import TaskDeferred
    from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
    from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

    tmp = Path(tempfile.mkdtemp(prefix="worker_slot_"))
    os.environ["AIRFLOW_ELASTIC_GPU_BROKER_URL"] = f"sqlite:///{tmp / 'broker.db'}"
    os.environ["AIRFLOW_ELASTIC_GPU_WORK_DIR"] = str(tmp / "jobs")
    trainer = tmp / "trainer.py"
    trainer.write_text(TRAINER)
    broker = GpuBroker(os.environ["AIRFLOW_ELASTIC_GPU_BROKER_URL"])
    args = {"task_id": "train", "command": f"{sys.executable} {trainer}", "total_steps": 5,
            "virtual_gpus": 2, "poll_interval": 0.2}
    rows: dict[str, list[float]] = {k: [] for k in (
        "worker_start_phase_s", "worker_complete_phase_s", "triggerer_submit_s")}
    for i in range(runs):
        # before: execute in the worker until TaskDeferred, then execute_complete
        ti = _TI(2 * i)
        op = ElasticTrainingOperator(**args)
        t0 = time.perf_counter()
        try:
            op.execute({"ti": ti})
        except TaskDeferred:
            pass
        rows["worker_start_phase_s"].append(time.perf_counter() - t0)
        _wait_terminal(broker, ti.xcom["job_id"])
        op = ElasticTrainingOperator(**args)
        t0 = time.perf_counter()
        op.execute_complete({"ti": ti}, {"job_id": ti.xcom["job_id"]})
        before_complete = time.perf_counter() - t0

        # after: the triggerer submits; the worker only runs execute_complete
        ti = _TI(2 * i + 1)
        op = ElasticTrainingOperator(**args, start_from_trigger=True)
        trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
        trigger.task_instance = SimpleNamespace(dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id,
                                                map_index=ti.map_index, try_number=1)
        t0 = time.perf_counter()
        job = asyncio.run(asyncio.to_thread(trigger._submit))
        rows["triggerer_submit_s"].append(time.perf_counter() - t0)
        _wait_terminal(broker, job.id)
        op = ElasticTrainingOperator(**args, start_from_trigger=True)
        t0 = time.perf_counter()
        op.execute_complete({"ti": ti}, {"job_id": job.id})
        rows["worker_complete_phase_s"].append(time.perf_counter() - t0)
        rows.setdefault("before_complete_phase_s", []).append(before_complete)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "runs": runs,
        "before_worker_slot_s": med["worker_start_phase_s"] + med["before_complete_phase_s"],
        "after_worker_slot_s": med["worker_complete_phase_s"],
        "median": med,
        "samples": rows,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per mode (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (JSON)")
    args = parser.parse_args(argv)
    result = run(args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"worker-slot seconds per training task (median of {args.runs})")
    table.add_column("mode")
    table.add_column("start phase (worker)", justify="right")
    table.add_column("complete phase (worker)", justify="right")
    table.add_column("total worker slot", justify="right")
    table.add_column("submit in triggerer", justify="right")
    m = result["median"]
    table.add_row("deferrable (today)", f"{m['worker_start_phase_s']:.3f}", f"{m['before_complete_phase_s']:.3f}",
                  f"{result['before_worker_slot_s']:.3f}", "-")
    table.add_row("start_from_trigger", "-", f"{m['worker_complete_phase_s']:.3f}",
                  f"{result['after_worker_slot_s']:.3f}", f"{m['triggerer_submit_s']:.3f}")
    Console().print(table)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
