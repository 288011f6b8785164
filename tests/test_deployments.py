"""Airflow deployments that share one broker (staging and production, two teams): each names itself
(``[elastic_gpu] deployment``) and its jobs' keys carry the name. Their DAGs, tasks and scheduled
runs' ids are often the same; without the name, a task of one reattached to the other's running
job (and took it over), and one's orphan check cancelled the other's job when its own task
instance of the same ids had ended."""

from __future__ import annotations

import asyncio
import sys

import pytest
from airflow.sdk.exceptions import AirflowFailException
from fastapi.testclient import TestClient
from test_airflow_tasks import _trigger_ti
from test_orphans import Airflow, StopRecorder

from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.types import JobSpec, task_key
from airflow_elastic_gpu.config import default_deployment
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.triggers.orphans import OrphanCheck, TaskId, task_of
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

VARIABLE = "AIRFLOW__ELASTIC_GPU__DEPLOYMENT"


def test_two_deployments_submitting_for_the_same_task_instance_ids_get_a_job_each(worker_env, monkeypatch):
    """The same DAG in staging and production, the same scheduled run: each deployment's trigger
    submits its own job; production's is never taken over by staging's try."""
    broker, _backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=2, poll_interval=0.2, start_from_trigger=True)
    jobs = {}
    for deployment, ti_id in (("production", "try-prod"), ("staging", "try-staging"), ("", "try-unnamed")):
        monkeypatch.setenv(VARIABLE, deployment)
        trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
        trigger.task_instance = _trigger_ti(run_id="scheduled__2026-11-29T00:00:00+00:00", ti_id=ti_id)
        jobs[deployment] = asyncio.run(asyncio.to_thread(trigger._submit)).id
    assert len(set(jobs.values())) == 3
    run = "sft/train/scheduled__2026-11-29T00:00:00+00:00/-1"
    for deployment, job_id in jobs.items():
        job = broker.job(job_id)
        assert job.key == (f"{deployment}/{run}" if deployment else run)
        assert job.attempt == {"production": "try-prod", "staging": "try-staging", "": "try-unnamed"}[deployment]
        assert not job.status.terminal


def _job(broker, deployment: str, attempt: str):
    spec = JobSpec("etl.train", "python train.py", 1, 1, total_steps=100, family="etl.train", attempt=attempt,
                   key=task_key("etl", "train", "scheduled__1", -1, deployment=deployment))
    return broker.start(broker.submit(spec).id, "ref")


def test_an_orphan_check_asks_only_about_its_own_deployments_jobs(pool):
    """Production's task ``etl.train`` of run ``scheduled__1`` has ended: production's check
    cancels production's job only; staging's job and an unnamed deployment's of the same ids train
    on, and Airflow is never asked about them."""
    jobs = {name: _job(pool, name, f"try-{name or 'unnamed'}") for name in ("production", "staging", "")}
    assert task_of(jobs["production"], "production") == TaskId("etl", "train", "scheduled__1", -1)
    assert task_of(jobs["production"]) is None and task_of(jobs["staging"], "production") is None
    assert task_of(jobs[""], "production") is None and task_of(jobs[""]) == TaskId("etl", "train", "scheduled__1", -1)
    airflow = Airflow({"scheduled__1": {"train": "success"}})
    backend, check = StopRecorder(), OrphanCheck(interval_s=60)
    assert check.run(pool, backend, "default", airflow, now_s=0.0, deployment="production") == []
    (cancelled,) = check.run(pool, backend, "default", airflow, now_s=60.0, deployment="production")
    assert cancelled.id == jobs["production"].id
    assert pool.job(jobs["staging"].id).status is JobStatus.RUNNING
    assert pool.job(jobs[""].id).status is JobStatus.RUNNING
    assert airflow.asked == [("etl", ["train"], ["scheduled__1"])] * 2  # production's job only


def test_a_deployment_name_is_checked_where_it_is_read(monkeypatch):
    assert default_deployment({}) == ""
    assert default_deployment({VARIABLE: " team-b.prod_2 "}) == "team-b.prod_2"
    for bad in ("a/b", "two words", "-lead", "x" * 65, "naïve"):
        with pytest.raises(ValueError, match=rf"\${VARIABLE} must be a name of letters, digits"):
            default_deployment({VARIABLE: bad})
    ti = _trigger_ti()
    monkeypatch.setenv(VARIABLE, "a/b")  # it would shift the key's segments: refused, not used
    from airflow_elastic_gpu.triggers.task_instance import task_key as ti_key
    with pytest.raises(AirflowFailException, match=f"{VARIABLE} must be a name"):  # no retry mends it
        ti_key(ti)


def test_the_page_finds_a_task_instances_job_of_its_own_deployment(pool):
    """``/jobs/by-task`` finds the job of the server's deployment (the plugin runs in that
    deployment's API server), or of the one the request names."""
    ours = pool.submit(JobSpec("t", "t", 1, 1, total_steps=10, key=task_key("etl", "train", "r1", -1, "production")))
    theirs = pool.submit(JobSpec("t", "t", 1, 1, total_steps=10, key=task_key("etl", "train", "r1", -1, "staging")))
    ids = {"dag_id": "etl", "task_id": "train", "run_id": "r1"}
    client = TestClient(create_app(pool, deployment="production"))
    assert client.get("/api/v1/jobs/by-task", params=ids).json()["id"] == ours.id
    assert client.get("/api/v1/jobs/by-task", params={**ids, "deployment": "staging"}).json()["id"] == theirs.id
    assert client.get("/api/v1/jobs/by-task", params={**ids, "deployment": ""}).status_code == 404
    assert client.get("/api/v1/jobs/by-task", params={**ids, "deployment": "a/b"}).status_code == 422
    assert TestClient(create_app(pool, deployment="")).get("/api/v1/jobs/by-task", params=ids).status_code == 404


def test_the_page_reads_its_deployment_at_each_request_and_a_bad_name_fails_only_those(pool, monkeypatch):
    """The plugin makes its app when Airflow's API server imports it: a bad name there failed the
    import, and the page, the API and the "GPU job" tab were gone. It is read when a task instance's
    job is looked up, and a bad one answers that request with an error that names it."""
    job = pool.submit(JobSpec("t", "t", 1, 1, total_steps=10, key=task_key("etl", "train", "r1", -1, "production")))
    ids = {"dag_id": "etl", "task_id": "train", "run_id": "r1"}
    monkeypatch.setenv(VARIABLE, "not a name")
    client = TestClient(create_app(pool), raise_server_exceptions=False)
    r = client.get("/api/v1/jobs/by-task", params=ids)
    assert r.status_code == 500 and f"${VARIABLE} must be a name" in r.text
    assert client.get("/api/v1/pools").status_code == 200
    monkeypatch.setenv(VARIABLE, "production")
    assert client.get("/api/v1/jobs/by-task", params=ids).json()["id"] == job.id


def test_a_bad_name_on_the_triggerer_fails_a_task_started_from_it_without_a_retry(worker_env, monkeypatch):
    """``start_from_trigger``: the triggerer's bad name crashed the trigger, and Airflow retried the
    task, to no effect; it is the error event of a configuration, which fails the task for good."""
    from test_airflow_tasks import _FakeTI

    _broker, _backend, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 10", total_steps=10,
                                 virtual_gpus=2, start_from_trigger=True)
    monkeypatch.setenv(VARIABLE, "not/a name")
    trigger = ElasticTrainingTrigger(**op.start_trigger_args.trigger_kwargs)
    trigger.task_instance = _trigger_ti()
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 60))
    assert event.payload["job_id"] is None and event.payload["retry"] is False
    with pytest.raises(AirflowFailException, match=f"could not start the training: .*{VARIABLE} must be a name"):
        op.execute_complete({"ti": _FakeTI()}, event.payload)
    assert _broker.jobs() == []
