"""The family prior: until a job is measured, the broker takes it to run as fast as its family's
other jobs (the running ones, else the latest finished run with samples), so that a scheduled
retraining is ranked by its last run's measured throughput, not by a guess."""

from __future__ import annotations

import pytest
from test_broker import spec

from airflow_elastic_gpu.broker.types import JobSpec


def test_family_history_is_each_family_s_latest_measured_run(pool, clock):
    """The prior's history holds one model per family: the latest finished run with samples (an
    older one is not returned, and a later run that finished unmeasured does not hide it)."""
    from airflow_elastic_gpu.broker.rebalance import family_history
    from airflow_elastic_gpu.scheduling.core import JobBook

    def run(key, steps_per_s, **kw):
        job = pool.submit(spec(key, family="nightly.train", **kw))
        pool.ack(job.id, 1)
        if steps_per_s:
            pool.progress(job.id, 0, generation=1)
            clock.advance(10)
            pool.progress(job.id, 10 * steps_per_s, generation=1)
        pool.finish(job.id)
        clock.advance(10)

    run("run-1", 5.0)
    run("run-2", 7.0)
    run("run-3", None, relative_speed={"T4": 1.0})  # finished before its first sample
    book = JobBook(job_id="next", min_gpus=1, max_gpus=4, total_steps=10, submit_s=0.0, family="nightly.train")
    with pool.engine.connect() as conn:
        history, by_type = family_history(conn, "default", [book])
    assert list(history) == ["nightly.train"]
    assert [t for _, t in by_type["nightly.train"]["virtual"].observed] == [pytest.approx(7.0)]  # its node's type
    assert [t for _, t in history["nightly.train"].observed] == [pytest.approx(7.0)]


@pytest.mark.parametrize("last_run_steps_per_s, first", [(1000.0, "nightly"), (1.0, "other")])
def test_a_scheduled_retraining_is_ranked_by_its_last_runs_measured_throughput(
        pool, clock, last_run_steps_per_s, first):
    """Two waiting jobs: one of 100,000 steps named like a finished job, one of 50,000 steps. The
    pool's median throughput (10 steps/s) would rank the shorter one first; the finished run of
    the same name says how fast a step of that training is."""
    def whole_pool(name, key, steps):
        return JobSpec(name=name, command="python train.py", key=key, min_gpus=4, max_gpus=4, total_steps=steps)

    last = pool.submit(whole_pool("nightly.train", "run-1", 10_000))
    pool.ack(last.id, 1)
    pool.progress(last.id, 0, generation=1)
    clock.advance(10)
    pool.progress(last.id, 10 * last_run_steps_per_s, generation=1)
    pool.finish(last.id)
    hog = pool.submit(whole_pool("hog", "hog", 1_000_000))
    pool.ack(hog.id, 1)
    pool.progress(hog.id, 0, generation=1)
    clock.advance(10)
    pool.progress(hog.id, 100, generation=1)
    jobs = {"other": pool.submit(whole_pool("other", "other", 50_000)),
            "nightly": pool.submit(whole_pool("nightly.train", "run-2", 100_000))}
    assert all(not pool.job(j.id).target_gpus for j in jobs.values())
    pool.finish(hog.id)
    started = {name for name, j in jobs.items() if pool.job(j.id).target_gpus}
    assert started == {first}


@pytest.mark.parametrize("last, waiting, shared", [
    (("sweep[0]", None), ("sweep[3]", None), True),  # the instances of one mapped task: one training
    (("train", "dag_a.train"), ("train", "dag_b.train"), False),  # one task id in two DAGs: two trainings
    (("nightly", "etl.train"), ("nightly, v2", "etl.train"), True),  # a task renamed its jobs
])
def test_a_waiting_job_s_prior_comes_from_its_family_not_its_name(pool, clock, last, waiting, shared):
    """As above, with a fast last run (1,000 steps/s): its speed ranks the longer waiting job first
    only when both are of one family."""
    def whole_pool(name, family, key, steps):
        return JobSpec(name=name, family=family, command="python train.py", key=key, min_gpus=4, max_gpus=4,
                       total_steps=steps)

    done = pool.submit(whole_pool(*last, "run-1", 10_000))
    pool.ack(done.id, 1)
    pool.progress(done.id, 0, generation=1)
    clock.advance(10)
    pool.progress(done.id, 10_000, generation=1)
    pool.finish(done.id)
    hog = pool.submit(whole_pool("hog", None, "hog", 1_000_000))
    pool.ack(hog.id, 1)
    pool.progress(hog.id, 0, generation=1)
    clock.advance(10)
    pool.progress(hog.id, 100, generation=1)
    jobs = {"other": pool.submit(whole_pool("other", None, "other", 50_000)),
            "next": pool.submit(whole_pool(*waiting, "run-2", 100_000))}
    pool.finish(hog.id)
    started = {name for name, j in jobs.items() if pool.job(j.id).target_gpus}
    assert started == ({"next"} if shared else {"other"})
