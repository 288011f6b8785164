"""Nightly batch retraining on the shared GPU pool, and promotion of the best model it produced.

``nightly_retraining`` runs one elastic training per model config (mapped tasks). Each training
declares the asset ``nightly_retraining_models`` as its outlet, so every finished training emits an
asset event whose ``extra`` holds its figures (final step, accuracy, GPU-hours, resizes, JCT, job
id). ``promote_best_model`` is scheduled on that asset: it evaluates the new models from those
events and promotes the most accurate one if it beats the model promoted before (a JSON pointer
``promoted/nightly_retraining_models.json`` in the provider's work directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Asset, task

from airflow_elastic_gpu.config import airflow_conf, default_work_dir
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}}"
MODELS = Asset("nightly_retraining_models")

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
):

    @task
    def jobs() -> list[dict]:
        return [{"command": f"{TORCHRUN} {TRAIN} --total-steps {c['steps']} --hidden {c['hidden']} "
                            "--log-every 20",
                 "total_steps": c["steps"], "job_name": c["name"]} for c in CONFIGS]

    ElasticTrainingOperator.partial(
        task_id="retrain", min_gpus=1, max_gpus=2, poll_interval=2.0, outlets=[MODELS],
    ).expand_kwargs(jobs())


with DAG(
    dag_id="promote_best_model",
    description="Evaluate the models a retraining produced and promote the best one",
    schedule=[MODELS],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["elastic-gpu"],
):

    @task
    def evaluate(*, triggering_asset_events=None) -> list[dict]:
        """The new models, from the asset events that triggered this run (one per training)."""
        candidates = [dict(e.extra) for e in triggering_asset_events[MODELS] if "accuracy" in e.extra]
        for c in candidates:
            print(f"{c['name']}: accuracy {c['accuracy']:.4f}, {c['gpu_hours']:.4f} GPU-hours, "
                  f"{c['num_resizes']} resizes, JCT {c['jct_s']:.0f} s")
        return candidates

    @task
    def promote(candidates: list[dict]) -> dict | None:
        """Point ``promoted/nightly_retraining_models.json`` at the most accurate model, unless the
        model promoted before was better."""
        if not candidates:
            return None
        best = max(candidates, key=lambda c: c["accuracy"])
        pointer = default_work_dir(conf=airflow_conf()) / "promoted" / f"{MODELS.name}.json"
        current = json.loads(pointer.read_text()) if pointer.exists() else None
        if current is not None and current["accuracy"] >= best["accuracy"]:
            print(f"kept {current['name']} ({current['accuracy']:.4f} >= {best['accuracy']:.4f})")
            return current
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(json.dumps(best, indent=2))
        print(f"promoted {best['name']} (job {best['job_id']}, accuracy {best['accuracy']:.4f})")
        return best

    promote(evaluate())
