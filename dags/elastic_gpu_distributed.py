"""Distributed demo: mapped real trainings that Celery workers start and several triggerers watch.

``make demo-distributed`` runs it under CeleryExecutor (see
:mod:`airflow_elastic_gpu.demo_distributed`). Each mapped ``train`` task is
``examples/train_digits.py`` under ``torchrun`` (gloo on the CPU: one process per virtual GPU),
slowed to ``step_ms`` milliseconds per step of the global batch so that a tiny model trains for
about a minute without using the CPU. Every training shares the one GPU pool of the broker.

Params (``airflow dags trigger --conf '{"jobs": 4}'``): ``jobs`` (trainings), ``steps`` (steps of
the middle-sized training; the others do 2/3 and 4/3 of it), ``step_ms`` (milliseconds per step
on one GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}}"

with DAG(
    dag_id="elastic_gpu_distributed",
    description="Mapped elastic trainings over Celery workers and several triggerers, one GPU pool",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_tasks=16,
    params={
        "jobs": Param(6, type="integer", minimum=1, maximum=32),
        "steps": Param(300, type="integer", minimum=10),
        "step_ms": Param(200.0, type="number", minimum=0),
    },
    tags=["elastic-gpu", "demo"],
):

    @task
    def jobs(params: dict | None = None) -> list[dict]:
        """One training per job: 2/3, 1 or 4/3 of ``steps``, in turn."""
        out = []
        for i in range(params["jobs"]):
            steps = params["steps"] * (2 + i % 3) // 3
            out.append({
                "command": f"{TORCHRUN} {TRAIN} --total-steps {steps} --hidden 64 --step-ms {params['step_ms']} "
                           "--checkpoint-every 20 --log-every 10",
                "total_steps": steps, "job_name": f"train-{i}",
            })
        return out

    ElasticTrainingOperator.partial(
        task_id="train", min_gpus=1, max_gpus=2, poll_interval=2.0, virtual_gpus=4,
        env={"OMP_NUM_THREADS": "1"},
    ).expand_kwargs(jobs())
