"""Test DAGs: a training whose outlet asset is its model, and a DAG scheduled on that asset."""

import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Asset, task

from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
MODEL = Asset(name="elastic_test_model", uri="file:///elastic-test/models/mlp-32")

with DAG(dag_id="elastic_asset_train", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         catchup=False):
    ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {TRAIN} --hidden 32 --log-every 20 "
                            "--total-steps 60", total_steps=60, min_gpus=1, max_gpus=2, poll_interval=0.5,
                            virtual_gpus=4, outlets=[MODEL])

with DAG(dag_id="elastic_asset_evaluate", schedule=[MODEL], start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         catchup=False):

    @task
    def evaluate(*, triggering_asset_events=None) -> dict:
        (event,) = triggering_asset_events[MODEL]
        return dict(event.extra)

    evaluate()
