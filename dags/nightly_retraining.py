"""Nightly batch retraining: one elastic training per model config, as mapped tasks on the shared GPU pool."""

from __future__ import annotations

import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, task

from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}}"

CONFIGS = [
    {"name": "mlp-128", "hidden": 128, "steps": 300},
    {"name": "mlp-256", "hidden": 256, "steps": 400},
    {"name": "mlp-512", "hidden": 512, "steps": 300},
]

with DAG(
    dag_id="nightly_retraining",
    description="Retrain every model config each night on the shared GPU pool",
    schedule="0 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["elastic-gpu"],
) as dag:

    @task
    def jobs() -> list[dict]:
        return [{"command": f"{TORCHRUN} {TRAIN} --total-steps {c['steps']} --hidden {c['hidden']} "
                            "--log-every 20",
                 "total_steps": c["steps"], "job_name": c["name"]} for c in CONFIGS]

    ElasticTrainingOperator.partial(
        task_id="retrain", min_gpus=1, max_gpus=2, poll_interval=2.0,
    ).expand_kwargs(jobs())
