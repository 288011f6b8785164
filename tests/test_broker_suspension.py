"""Suspension in the broker: a preemptible job resized to zero GPUs, acked, then resumed; the two-phase
protocol and the one-GPU-one-job invariant as for any resize."""

import pytest

from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec
from airflow_elastic_gpu.states import JobStatus


def spec(key, **kw):
    kw.setdefault("min_gpus", 2)
    kw.setdefault("max_gpus", 2)
    return JobSpec(name=key, command="python train.py", key=key, **kw)


@pytest.fixture
def pool(broker):
    broker.register_node("n0", 2)
    broker.configure_pool(policy_params={"suspend": True}, lease_s=3600)
    return broker


def running_long_job(pool, clock, **kw):
    """A 2-GPU job measured at 10 steps/s with ~10,000 s left, past its minimum runtime."""
    long = pool.submit(spec("long", total_steps=100_000, **kw))
    pool.ack(long.id, 1)
    for step in (0, 100):
        pool.progress(long.id, step, generation=1)
        clock.advance(10)
    clock.advance(700)
    return long


def test_a_preemptible_job_is_suspended_acked_and_resumed(pool, clock):
    long = running_long_job(pool, clock, preemptible=True)
    short = pool.submit(spec("short", total_steps=100))
    long_now = pool.job(long.id)
    assert long_now.status is JobStatus.SUSPENDED and long_now.suspended
    assert long_now.target_gpus == () and long_now.target_generation == 2
    assert len(long_now.in_use_gpus) == 2, "it keeps its GPUs until the agent acks the stop"
    assert pool.job(short.id).target_gpus == ()
    assert pool.target(long.id).gpus == ()
    assert pool.ack(long.id, 2) is True
    assert pool.job(long.id).in_use_gpus == ()
    short_now = pool.job(short.id)
    assert len(short_now.target_gpus) == 2 and short_now.status is JobStatus.RUNNING
    pool.ack(short.id, 1)
    clock.advance(20)
    pool.finish(short.id)
    long_now = pool.job(long.id)
    assert long_now.status is JobStatus.RUNNING and len(long_now.target_gpus) == 2
    assert long_now.target_generation == 3
    kinds = [e.kind for e in pool.events(job_id=long.id)]
    assert "suspend" in kinds and kinds.index("suspend") < kinds.index("resume")


def test_a_suspended_job_holds_no_gpu_so_its_silence_is_no_loss_until_it_is_resumed(pool, clock):
    """Once it acked its suspension a job holds no GPU, and its agent may be gone (a pod deleted
    while the job waits): it is not reaped however long it waits. Its resume publishes GPUs,
    which an agent must then take up within the lease."""
    long = running_long_job(pool, clock, preemptible=True)
    short = pool.submit(spec("short", total_steps=100))
    pool.ack(long.id, 2)
    pool.ack(short.id, 1)
    clock.advance(5 * 3600)  # the long job's agent is silent for five leases; the short one beats
    pool.heartbeat(short.id)
    pool.rebalance()
    assert pool.job(long.id).status is JobStatus.SUSPENDED
    pool.finish(short.id)
    assert pool.job(long.id).status is JobStatus.RUNNING  # resumed: 2 GPUs published
    clock.advance(1800)
    pool.rebalance()  # a call within the lease (else the silence of every caller reads as an outage)
    clock.advance(1801)
    pool.rebalance()
    lost = pool.job(long.id)
    assert lost.status is JobStatus.LOST and lost.target_gpus == () and "since its last heartbeat or placement" in lost.reason


def test_a_job_that_did_not_opt_in_is_never_suspended(pool, clock):
    long = running_long_job(pool, clock)
    short = pool.submit(spec("short", total_steps=100))
    assert pool.job(long.id).status is JobStatus.RUNNING and len(pool.job(long.id).target_gpus) == 2
    assert pool.job(short.id).status is JobStatus.QUEUED


def test_a_pool_without_the_suspend_setting_never_suspends(broker, clock):
    broker.register_node("n0", 2)
    broker.configure_pool(lease_s=3600)
    long = running_long_job(broker, clock, preemptible=True)
    broker.submit(spec("short", total_steps=100))
    assert broker.job(long.id).status is JobStatus.RUNNING


def test_preemptible_must_be_a_boolean():
    with pytest.raises(InvalidRequest, match="preemptible"):
        spec("x", preemptible="yes")
