"""A trainer's absurd progress report is a step, not a throughput sample: the pool goes on being
scheduled (on SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
from test_broker import spec

from airflow_elastic_gpu.broker.rows import _model
from airflow_elastic_gpu.scheduling.throughput import SPEED_RANGE, ThroughputModel


@pytest.mark.parametrize("absurd", [1e308, 5e-324])
def test_an_absurd_speed_is_no_sample_and_the_pool_is_still_scheduled(pool, clock, absurd):
    """A step of 1e308 half a second after step 0 (an infinite speed) or of 5e-324 (a denormal one)
    was folded into the job's model: every later rebalance of the pool divided by zero, and no job
    of it was started or resized until that job ended."""
    a = pool.submit(spec("a", min_gpus=1, max_gpus=2, total_steps=10**6))
    pool.ack(a.id, 1)
    clock.advance(10)
    pool.progress(a.id, 0, generation=1)
    clock.advance(0.5)
    pool.progress(a.id, absurd, generation=1)
    assert pool.job(a.id).steps_done == absurd  # the step counts
    b = pool.submit(spec("b", min_gpus=2, max_gpus=2, total_steps=100))
    assert len(pool.job(b.id).target_gpus) == 2, "the newcomer was started"
    clock.advance(10)
    pool.progress(a.id, absurd * 2 if absurd < 1 else absurd, generation=pool.job(a.id).acked_generation)
    pool.rebalance()


def test_a_familys_samples_scaled_out_of_range_still_make_a_model():
    """The range is a reported sample's: a family's curve scaled through a job's own sample may leave
    it (4e8 steps/s on 4 GPUs, scaled 10x), and refusing it failed every rebalance of the pool."""
    from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore
    from airflow_elastic_gpu.scheduling.policy import get_policy
    from airflow_elastic_gpu.scheduling.state import GpuId, NodeState

    a = JobBook("a", 1, 8, 10**9, 0.0, family="f")
    a.throughput = ThroughputModel(((1, 1.0), (4, 4e8)))
    a.target = a.in_use = (GpuId("n0", 0),)
    a.target_generation = a.acked_generation = 1
    b = JobBook("b", 1, 8, 10**6, 1.0, family="f")
    b.throughput = ThroughputModel(((1, 10.0),))
    published = SchedulingCore(get_policy("adaptive"), 10.0).rebalance([NodeState("n0", tuple(range(8)))], [a, b], 100.0)
    assert {p.job_id for p in published} == {"a", "b"}


def test_a_model_takes_no_sample_out_of_range_and_a_stored_one_is_left_out():
    with pytest.raises(ValueError, match="bad throughput sample: inf steps/s on 2 GPUs"):
        ThroughputModel().with_sample(2, float("inf"))
    with pytest.raises(ValueError, match="bad throughput sample"):
        ThroughputModel().with_sample(1, SPEED_RANGE[0] / 10)
    with pytest.raises(ValueError, match="bad throughput sample: inf"):
        ThroughputModel(((1, float("inf")),))
    assert ThroughputModel().with_sample(1, SPEED_RANGE[1]).observed == ((1, SPEED_RANGE[1]),)
    # what an earlier version stored (SQLite's JSON keeps Infinity) is read without it
    assert _model([[1, float("inf")], [2, 3.0]]).observed == ((2, 3.0),)
    assert _model([[1, 5e-324]]).observed == ()
