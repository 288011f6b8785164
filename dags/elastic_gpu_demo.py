"""Demo: four real PyTorch trainings share a pool of virtual GPUs; the broker resizes them while they run.

Each training is ``examples/train_digits.py`` under ``torchrun`` (gloo on the
CPU: one process per virtual GPU). They start together, so the broker admits
them at their minimum and hands out the rest by predicted gain; as jobs end or
are measured, it grows and shrinks the others. The last task prints a summary.

A step of the global batch takes at least ``STEP_MS`` on one GPU and 1/N of it
on N (``train_digits --step-ms``: each worker sleeps out the rest of its share),
as a model larger than this one would on real GPUs: on a CPU of two cores the
virtual GPUs share the cores, so without it more GPUs would not train faster
and the demo's length would depend on the machine's speed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, task

from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}}"
POOL = os.environ.get("ELASTIC_GPU_DEMO_POOL", "default")
STEP_MS = 50  # per step of the global batch on one GPU (see the module docstring)

JOBS = {  # task id: (total steps, min GPUs, max GPUs, hidden units)
    "train_small": (400, 1, 2, 128),
    "train_medium": (1200, 1, 3, 128),
    "train_large": (2400, 1, 4, 256),
    "train_wide": (1600, 2, 4, 256),
}

with DAG(
    dag_id="elastic_gpu_demo",
    description="Concurrent elastic trainings sharing virtual GPUs",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_tasks=8,
    tags=["elastic-gpu", "demo"],
) as dag:
    trainings = [
        ElasticTrainingOperator(
            task_id=task_id,
            command=(f"{TORCHRUN} {TRAIN} --total-steps {steps} --hidden {hidden} --step-ms {STEP_MS} "
                     "--checkpoint-every 50 --log-every 20"),
            total_steps=steps,
            min_gpus=lo,
            max_gpus=hi,
            gpu_pool=POOL,
            poll_interval=2.0,
            virtual_gpus=4,
            env={"OMP_NUM_THREADS": "1"},
        )
        for task_id, (steps, lo, hi, hidden) in JOBS.items()
    ]

    @task
    def summary(results: list[dict]) -> dict:
        """Print one line per job (JCT, resizes, GPU-seconds, accuracy) and return the lot."""
        print(f"{'job':<10} {'JCT s':>8} {'resizes':>8} {'GPU-s':>8} {'accuracy':>9}")
        for r in results:
            print(f"{r['job_id'][:8]:<10} {r['jct_s']:>8.1f} {r['num_resizes']:>8} "
                  f"{r['gpu_seconds']:>8.0f} {r.get('accuracy', float('nan')):>9.3f}")
        return {"jobs": len(results), "resizes": sum(r["num_resizes"] for r in results)}

    summary([t.output for t in trainings])
