"""Termination-based resizing in the simulator: a re-created pod's parts (``RecreateModel``), its
wait for GPUs others took meanwhile, and the restart overhead the policy measures for it."""

from __future__ import annotations

from collections import defaultdict

import pytest

from airflow_elastic_gpu.simulator.engine import (
    ClusterShape,
    RecreateModel,
    RestartOverheads,
    SimulationError,
    simulate,
)
from airflow_elastic_gpu.simulator.trace import TraceJob


def test_a_recreated_job_waits_for_gpus_that_others_took_meanwhile():
    """Termination-based resizing: the shrunk job's pod is deleted; while it terminates four short
    jobs arrive, and once it is gone they are placed first (least remaining work), so the
    re-created pod waits for a GPU. Resized in place, the job keeps its GPUs and never waits. (A
    30 s termination, Kubernetes' grace period at its longest, so that they arrive meanwhile.)"""
    trace = [TraceJob("long", 0, 1, 20_000, "imagenet")] + [
        TraceJob(f"s{i}", 3000 + 5 * i, 1, 1200, "imagenet") for i in range(4)]
    slow_stop = RestartOverheads(recreate=RecreateModel(grace_period_s=30.0))
    t = simulate(trace, ClusterShape(1, 4), "termination", overheads=slow_stop)
    long = next(j for j in t.jobs if j.job_id == "long")
    assert long.recreate_wait_s > 0
    gone = next(time for time, job, n in t.allocations if job == "long" and n == 0)
    back = gone + long.recreate_wait_s
    held: dict[str, int] = defaultdict(int)
    for time, job, n in t.allocations:  # while it waited, the others held every GPU
        held[job] = n
        if gone < time < back:
            assert held["long"] == 0 and sum(held.values()) == 4
    a = simulate(trace, ClusterShape(1, 4), "adaptive")
    assert all(j.recreate_wait_s == 0 for j in a.jobs)
    assert all(n > 0 for time, job, n in a.allocations if job == "long" and time < a.jobs[0].end_s)


def test_a_recreated_jobs_wait_for_gpus_is_not_taken_for_its_restart_overhead(monkeypatch):
    """The policy measures a re-created job's restart overhead from the resize's publication: the
    old pod's termination and the new pod's start, not its wait for GPUs in between. With the wait
    counted (here 430 s; hours on a busy pool), a job needed a gain of twice its wait to be
    resized again and stayed where it was placed (yolov3 on one GPU for 50,000 s)."""
    from airflow_elastic_gpu.simulator.schedulers import PolicyScheduler

    trace = [TraceJob("long", 0, 1, 20_000, "imagenet")] + [
        TraceJob(f"s{i}", 3000 + 5 * i, 1, 1200, "imagenet") for i in range(4)]
    model = RecreateModel(grace_period_s=30.0)
    overheads: dict[str, float | None] = {}
    finish = PolicyScheduler.finish

    def recorded(self, sid, now):
        book = self.jobs.get(sid)
        if book is not None:
            overheads[book.job_id] = book.restart_overhead_s
        return finish(self, sid, now)

    monkeypatch.setattr(PolicyScheduler, "finish", recorded)
    t = simulate(trace, ClusterShape(1, 4), "termination", overheads=RestartOverheads(recreate=model))
    assert next(j for j in t.jobs if j.job_id == "long").recreate_wait_s > 400
    assert overheads["long"] is not None and overheads["long"] <= model.cost_s + 60  # a rebalance's sample


def test_recreate_model_adds_its_parts_and_a_total_overrides_them():
    model = RecreateModel(grace_period_s=30, scheduling_s=1, image_cached=False, image_size_mb=1000,
                          pull_bandwidth_mb_s=100, container_start_s=4, init_s=5)
    assert model.pull_s == pytest.approx(10.0)
    assert (model.stop_s, model.start_s) == pytest.approx((30.0, 20.0))
    assert RecreateModel(image_cached=True).pull_s == 0
    assert RestartOverheads(recreate=model).of("recreate") == pytest.approx(50.0)
    for total, parts in ((120.0, (30.0, 90.0)), (10.0, (10.0, 0.0))):
        r = RestartOverheads(recreate_s=total, recreate=model)
        assert r.of("recreate") == pytest.approx(total)
        assert (r.recreate.stop_s, r.recreate.start_s) == pytest.approx(parts)
    with pytest.raises(SimulationError, match="pull_bandwidth_mb_s must be > 0"):
        RecreateModel(pull_bandwidth_mb_s=0)
    with pytest.raises(SimulationError, match="grace_period_s"):
        RecreateModel(grace_period_s=-1)
