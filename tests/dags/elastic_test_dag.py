"""Test DAG: one small elastic training and a training mapped over three configs."""

import os
import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
STEPS = int(os.environ.get("ELASTIC_TEST_STEPS", "120"))
CMD = f"{sys.executable} {TRAIN} --hidden 64 --log-every 20 --total-steps "

with DAG(dag_id="elastic_test", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         catchup=False) as dag:
    single = ElasticTrainingOperator(task_id="single", command=CMD + str(STEPS), total_steps=STEPS,
                                     min_gpus=1, max_gpus=2, poll_interval=0.5, virtual_gpus=4)
    mapped = ElasticTrainingOperator.partial(
        task_id="mapped", total_steps=STEPS, min_gpus=1, max_gpus=1, poll_interval=0.5, virtual_gpus=4,
    ).expand(command=[CMD + str(STEPS) + f" --seed {s}" for s in range(3)])
    single >> mapped
