"""The operator and the trigger where a try meets a moment's trouble or a value no retry mends: a
triggerer that could not follow a job which then succeeded, a connection Airflow could not read for
a moment, and rendered arguments that can never start (retried, each try after its delay, before)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
from airflow.exceptions import AirflowException
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from test_airflow_failures import _ended_job, first_event_once_mended
from test_airflow_tasks import _FakeTI
from test_sidecar import wait_for

from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.links.job import ElasticJobLink
from airflow_elastic_gpu.operators.training import ElasticTrainingOperator
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger


def _submitted(op: ElasticTrainingOperator) -> tuple[_FakeTI, str]:
    """``op`` run up to its deferral: the job submitted and started."""
    ti = _FakeTI()
    with pytest.raises(TaskDeferred):
        op.execute({"ti": ti})
    return ti, ti.xcom["job_id"]


def test_a_job_that_succeeded_while_the_triggerer_could_not_reach_the_broker_returns_its_result(worker_env):
    """The triggerer could not reach the broker around the task's deadline and fired a time-out; the
    job had succeeded meanwhile, as the worker's broker says. The worker cancelled nothing but failed
    the task, throwing the trained result away (for good with ``retries=0``). It returns it now."""
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 5", total_steps=5,
                                 virtual_gpus=2, poll_interval=0.1)
    ti, job_id = _submitted(op)
    wait_for(lambda: broker.job(job_id).status.terminal, 30, "the job to end")
    assert broker.job(job_id).status is JobStatus.SUCCEEDED
    event = {"job_id": job_id, "status": "error", "timed_out": True, "deadline_s": time.time() - 1,
             "reason": "execution_timeout: the triggerer could not cancel the job: connection refused"}
    result = op.execute_complete({"ti": ti}, event)
    assert result["job_id"] == job_id and result["final_step"] == 5
    assert broker.job(job_id).status is JobStatus.SUCCEEDED


def test_a_job_still_running_at_a_time_out_the_triggerer_could_not_carry_out_is_cancelled_for_a_retry(worker_env):
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 100000",
                                 total_steps=100000, virtual_gpus=2, poll_interval=0.1)
    ti, job_id = _submitted(op)
    event = {"job_id": job_id, "status": "error", "timed_out": True, "deadline_s": time.time() - 1,
             "reason": "execution_timeout: the triggerer could not cancel the job"}
    with pytest.raises(AirflowException, match="execution_timeout") as raised:
        op.execute_complete({"ti": ti}, event)
    assert not isinstance(raised.value, AirflowFailException)
    assert broker.job(job_id).status is JobStatus.CANCELLED


def test_a_task_started_from_the_triggerer_that_the_worker_follows_gets_its_job_link(worker_env):
    """``start_from_trigger``: the triggerer pushes no XCom, so the job's link comes when the task
    resumes. When the triggerer could not follow the job, the worker followed it for hours, and the
    task had no link to the job at all."""
    broker, _, _ = worker_env
    broker.register_node("localhost", 2)
    job = broker.submit(JobSpec("train", "python train.py", 1, 2, total_steps=10))
    broker.ack(job.id, 1)
    broker.finish(job.id, 0, {"final": True, "step": 10})
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.1,
                                 start_from_trigger=True)
    ti = _FakeTI()
    event = {"job_id": job.id, "status": "error", "reason": "could not start or reattach to the job: refused"}
    assert op.execute_complete({"ti": ti}, event)["job_id"] == job.id
    assert ti.xcom["job_id"] == job.id and ti.xcom["gpu_pool"] == "default"
    assert ti.xcom[ElasticJobLink().xcom_key] == ElasticJobLink.url("default", job.id)


def test_a_rendered_relative_checkpoint_dir_fails_the_task_without_retries_and_submits_nothing(worker_env):
    """``checkpoint_dir="ckpt/{{ run_id }}"`` parses; rendered, it is relative: every try failed with
    a retryable error, each after its retry delay, though a retry renders the same value."""
    broker, _, trainer = worker_env
    op = ElasticTrainingOperator(task_id="train", command=f"{sys.executable} {trainer} x 5", total_steps=5,
                                 virtual_gpus=2, poll_interval=0.1, checkpoint_dir="ckpt/{{ run_id }}")
    op.checkpoint_dir = "ckpt/manual__1"  # as Airflow renders it
    with pytest.raises(AirflowFailException, match="checkpoint_dir 'ckpt/manual__1' must be an absolute path"):
        op.execute({"ti": _FakeTI()})
    assert broker.jobs() == []
    # an absolute templated one parses (it is checked once rendered), and a Jinja comment's quote too
    ElasticTrainingOperator(task_id="ok", command="python train.py {# don't pass --fast #} --steps 10", total_steps=5,
                            checkpoint_dir="{{ var.value.checkpoint_root }}/{{ run_id }}")


def test_a_trigger_that_starts_a_job_with_a_relative_checkpoint_dir_fires_an_error_without_retries(worker_env,
                                                                                                   monkeypatch):
    broker, _, _ = worker_env
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.1,
                                 start_from_trigger=True, virtual_gpus=2)
    kwargs = op._trigger_kwargs(job_id=None, labels=None)
    trigger = ElasticTrainingTrigger(**{**kwargs, "checkpoint_dir": "ckpt/manual__1"})  # as rendered
    trigger.task_instance = _FakeTI()
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
    assert event.payload["job_id"] is None and event.payload["retry"] is False
    assert "must be an absolute path" in event.payload["reason"]
    assert broker.jobs() == []
    # a bad pool in the connection is mended there: a retry reads it again
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"url": str(broker.engine.url), "pool": "team/a"}}))
    trigger = ElasticTrainingTrigger(**kwargs)
    trigger.task_instance = _FakeTI()
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), 30))
    assert event.payload["retry"] is True and "the connection's pool must not contain '/'" in event.payload["reason"]


def test_a_trigger_on_a_distributed_airflow_that_reads_no_connection_for_a_moment_reads_it_again(
        worker_env, monkeypatch):
    """CeleryExecutor with the broker in the connection only: a connection Airflow could not read
    for a moment (reported as not defined) left the triggerer no broker, which it took for a
    configuration error; the task's worker then followed the job for its whole length. It reads
    the connection again now, as it does when its broker has no such job."""
    broker, _, _ = worker_env
    job = _ended_job(broker)
    url = os.environ["AIRFLOW_ELASTIC_GPU_BROKER_URL"]
    monkeypatch.delenv("AIRFLOW_ELASTIC_GPU_BROKER_URL")
    monkeypatch.delenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, poll_interval=0.1)
    trigger = ElasticTrainingTrigger(**op._trigger_kwargs(job_id=job.id, labels=None))
    # several polls without a connection; then it is readable again
    event = first_event_once_mended(trigger, lambda: monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"url": url}})))
    assert event.payload["status"] == "succeeded" and event.payload["job_id"] == job.id
