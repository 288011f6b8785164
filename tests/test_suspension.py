"""Suspension (a resize to zero GPUs) of preemptible jobs: the policy rule, the core's publish and the simulator."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore
from airflow_elastic_gpu.scheduling.publish import publishable
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, JobState, NodeState
from airflow_elastic_gpu.scheduling.suspension import SuspensionRule
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.simulator.engine import ClusterShape, RestartOverheads, simulate
from airflow_elastic_gpu.simulator.trace import TraceJob

LINEAR = ThroughputModel(prior_alpha=0.0, prior_steps_per_s=1.0)
NODE = NodeState("n0", (0, 1))
BOTH = (GpuId("n0", 0), GpuId("n0", 1))
SUSPEND = AdaptivePolicy(suspend=True, min_runtime_s=600.0, max_suspensions_per_hour=2)


def long_job(**kw):
    """A job on both GPUs of NODE with 10,000 s of work left, started at t=0."""
    fields = dict(allocation=BOTH, steps_done=0.0, last_resize_s=None, last_start_s=0.0,
                  preemptible=True, throughput=LINEAR, restart_overhead_s=10.0)
    fields.update(kw)
    return JobState("long", 2, 2, 20_000, **fields)


def short_job(**kw):
    return JobState("short", 2, 2, kw.pop("steps", 200), submit_time_s=3000.0, throughput=LINEAR,
                    restart_overhead_s=10.0, **kw)


def decide(policy, *jobs, now=3600.0):
    return policy.decide(ClusterState((NODE,), jobs, now))


def test_a_preemptible_long_job_is_suspended_for_a_much_shorter_waiting_one():
    d = decide(SUSPEND, long_job(), short_job())
    assert d.allocations["long"] == ()
    assert set(d.allocations["short"]) == set(BOTH)
    assert d.reasons["long"].startswith("suspend")


def test_suspension_is_off_by_default_and_needs_the_job_to_opt_in():
    assert decide(AdaptivePolicy(), long_job(), short_job()).allocations["long"] == BOTH
    assert decide(SUSPEND, long_job(preemptible=False), short_job()).allocations["long"] == BOTH


def test_a_preemptible_long_job_gives_its_gpus_to_a_shorter_running_job_that_can_use_them():
    """Not only for waiting jobs: a shorter running job that scales grows onto the long job's GPUs
    (heSRPT's allocation), when the exchange pays the restart overheads. Without opt-in, or when
    the long job is only a little longer and slow to restart, the long job keeps its minimum."""
    node = NodeState("n0", (0, 1, 2, 3))
    running_short = JobState("short", 1, 4, 2_000, allocation=(GpuId("n0", 0), GpuId("n0", 1)), last_start_s=0.0,
                             last_resize_s=0.0, throughput=LINEAR, restart_overhead_s=10.0)
    long = long_job(allocation=(GpuId("n0", 2), GpuId("n0", 3)))
    d = SUSPEND.decide(ClusterState((node,), (running_short, long), 3600.0))
    assert d.allocations["long"] == () and len(d.allocations["short"]) == 4
    assert d.reasons["long"].startswith("suspend")
    kept = SUSPEND.decide(ClusterState((node,), (running_short, long_job(allocation=long.allocation,
                                                                         preemptible=False)), 3600.0))
    assert len(kept.allocations["long"]) == 2 and len(kept.allocations["short"]) == 2
    # 1,100 s left on 2 GPUs, a 300 s restart: 1,100 - 500 - 310 does not exceed 2 x 310
    near = long_job(allocation=long.allocation, steps_done=20_000 - 2_200, restart_overhead_s=300.0)
    assert len(SUSPEND.decide(ClusterState((node,), (running_short, near), 3600.0)).allocations["long"]) == 2


def test_a_job_is_never_suspended_for_the_growth_of_a_later_ranked_one():
    """A preemptible job that scales poorly (its 4 GPUs are 1.2x one) ranked before a long linear
    job: giving its GPUs to the long job's growth would score higher in the hand-out (and the
    exchange with the first job, which could grow by one, pays), but SRPT suspends a job only for
    better-ranked ones, so it keeps them."""
    node = NodeState("n0", tuple(range(6)))
    first = JobState("first", 1, 2, 100, allocation=(GpuId("n0", 0),), last_start_s=0.0, last_resize_s=0.0,
                     throughput=LINEAR, restart_overhead_s=10.0)
    poor = ThroughputModel(((1, 1.0), (4, 1.2)))
    middle = JobState("middle", 4, 4, 5_000, allocation=tuple(GpuId("n0", i) for i in (1, 2, 3, 4)),
                      last_start_s=0.0, last_resize_s=0.0, preemptible=True, throughput=poor, restart_overhead_s=10.0)
    last = JobState("last", 1, 4, 1_000_000, allocation=(GpuId("n0", 5),), last_start_s=0.0, last_resize_s=0.0,
                    throughput=LINEAR, restart_overhead_s=10.0)
    d = SUSPEND.decide(ClusterState((node,), (first, middle, last), 3600.0))
    assert len(d.allocations["middle"]) == 4 and len(d.allocations["last"]) == 1


def test_a_job_is_not_suspended_when_most_of_its_gpus_would_stay_idle():
    """A shorter job could grow by one GPU onto the long job's four: the other three would be left
    to nobody (the long job needs all four), so the long job keeps them."""
    node = NodeState("n0", tuple(range(8)))
    short = JobState("a", 1, 5, 4_000, allocation=tuple(GpuId("n0", i) for i in range(4)), last_start_s=0.0,
                     last_resize_s=0.0, throughput=LINEAR, restart_overhead_s=10.0)
    long = JobState("r", 4, 4, 1_000_000, allocation=tuple(GpuId("n0", i) for i in range(4, 8)),
                    last_start_s=0.0, last_resize_s=0.0, preemptible=True, throughput=LINEAR,
                    restart_overhead_s=10.0)
    d = SUSPEND.decide(ClusterState((node,), (short, long), 3600.0))
    assert len(d.allocations["r"]) == 4 and len(d.allocations["a"]) == 4


def test_gpus_idle_either_way_do_not_keep_a_job_from_a_suspension_that_uses_all_of_its_own():
    """Nodes of 4, 4 and 3 GPUs: the shorter job grows onto all 4 of the long job's GPUs (a whole
    node) and the 3-GPU node stays idle whether or not the long job is suspended."""
    nodes = (NodeState("n0", (0, 1, 2, 3)), NodeState("n1", (0, 1, 2, 3)), NodeState("n2", (0, 1, 2)))
    short = JobState("a", 4, 8, 4_000, allocation=tuple(GpuId("n0", i) for i in range(4)), last_start_s=0.0,
                     last_resize_s=0.0, throughput=LINEAR, restart_overhead_s=10.0)
    long = JobState("r", 4, 4, 1_000_000, allocation=tuple(GpuId("n1", i) for i in range(4)),
                    last_start_s=0.0, last_resize_s=0.0, preemptible=True, throughput=LINEAR,
                    restart_overhead_s=10.0)
    d = SUSPEND.decide(ClusterState(nodes, (short, long), 3600.0))
    assert d.allocations["r"] == () and len(d.allocations["a"]) == 8


def test_a_job_is_not_suspended_before_its_minimum_runtime():
    d = decide(SUSPEND, long_job(last_start_s=3100.0), short_job())
    assert d.allocations["long"] == BOTH and d.allocations["short"] == ()


def test_a_job_is_not_suspended_more_often_than_the_hourly_cap():
    d = decide(SUSPEND, long_job(suspensions_s=(1000.0, 2000.0)), short_job())
    assert d.allocations["long"] == BOTH
    d = decide(SUSPEND, long_job(suspensions_s=(0.0, 2000.0)), short_job(), now=3700.0)
    assert d.allocations["long"] == (), "a suspension older than an hour no longer counts"


def test_a_suspension_that_does_not_pay_its_restart_overheads_is_not_made():
    near = long_job(steps_done=20_000 - 250)  # 250 s left against the newcomer's 200 s
    assert decide(SUSPEND, near, short_job()).allocations["long"] == BOTH


def test_a_higher_priority_job_is_never_suspended_for_a_lower_priority_one():
    assert decide(SUSPEND, long_job(priority=1), short_job()).allocations["long"] == BOTH
    d = decide(SUSPEND, long_job(), short_job(priority=1, steps=15_000))
    assert d.allocations["long"] == (), "a higher-priority waiting job ranks first"


def test_a_suspended_job_resumes_when_gpus_are_free():
    suspended = long_job(allocation=(), suspensions_s=(3600.0,))
    assert suspended.suspended
    d = decide(SUSPEND, suspended, now=4000.0)
    assert set(d.allocations["long"]) == set(BOTH)
    assert d.reasons["long"].startswith("resume")


def test_the_exchange_gain_is_the_srpt_swap_net_of_both_restart_overheads():
    rule = SuspensionRule(hysteresis=0.0)
    gain = rule.gain_s(long_job(steps_done=1000), 2, short_job(), 2)
    assert gain == pytest.approx((19_000 - 200) / 2 - 20.0)


@pytest.mark.parametrize("kw", [{"min_runtime_s": -1}, {"max_per_hour": 0}, {"max_per_hour": 1.5},
                                {"hysteresis": -0.1}])
def test_bad_suspension_limits_are_refused(kw):
    with pytest.raises(ValueError):
        SuspensionRule(**kw)


def test_publish_takes_a_started_job_to_zero_only_when_it_may_be_suspended():
    args = (["a"], {"a": ("g",)}, {"a": ()}, {"g": "a"}, {"g": "a"}, {"a"})
    assert publishable(*args) == []
    assert publishable(*args, suspendable={"a"}) == [("a", frozenset())]


def test_publish_changes_nothing_of_a_finishing_job():
    """Some trainers of the job have exited cleanly (a gang of pods): neither suspended, shrunk nor
    grown until it ends."""
    args = (["a"], {"a": ("g",)}, {"a": ()}, {"g": "a"}, {"g": "a"}, {"a"})
    assert publishable(*args, suspendable={"a"}, fixed={"a"}) == []
    grow = (["a"], {"a": ("g",)}, {"a": ("g", "h")}, {"g": "a"}, {"g": "a"}, {"a"})
    assert publishable(*grow) == [("a", frozenset({"g", "h"}))]
    assert publishable(*grow, fixed={"a"}) == []


def test_the_core_records_suspensions_and_resumes():
    core = SchedulingCore(SUSPEND, 10.0)
    long = JobBook("long", 2, 2, 20_000, 0.0, preemptible=True, throughput=LINEAR)
    core.rebalance([NODE], [long], 0.0)
    assert long.target == BOTH and long.last_start_s == 0.0
    long.in_use, long.acked_generation = long.target, long.target_generation
    short = JobBook("short", 2, 2, 200, 3000.0, throughput=LINEAR)
    pubs = core.rebalance([NODE], [long, short], 3600.0)
    assert [(p.job_id, p.gpus) for p in pubs] == [("long", ())]  # the GPUs follow after the ack
    assert long.suspended and long.suspensions_s == (3600.0,)
    long.in_use, long.acked_generation = (), long.target_generation
    core.rebalance([NODE], [long, short], 3601.0)
    assert short.target == BOTH
    (resume,) = core.rebalance([NODE], [long], 3700.0)  # the short job finished
    assert resume.gpus == BOTH and resume.previous_gpus == 0
    assert long.last_start_s == 3700.0 and not long.suspended


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 5000), st.floats(0, 4000)),
                min_size=1, max_size=8))
def test_suspending_decisions_never_double_book_nor_cut_a_non_preemptible_job(jobs_drawn):
    nodes = (NodeState("n0", tuple(range(4))), NodeState("n1", tuple(range(4))))
    free = [g for n in nodes for g in n.gpus()]
    jobs = []
    for k, (running, preemptible, steps, started) in enumerate(jobs_drawn):
        alloc = ()
        if running and free:
            alloc, free = (free[0],), free[1:]
        jobs.append(JobState(f"j{k}", 1, 4, steps, allocation=alloc, preemptible=preemptible,
                             last_start_s=started if alloc else None, throughput=LINEAR))
    d = AdaptivePolicy(suspend=True).decide(ClusterState(nodes, tuple(jobs), 4000.0))
    given_out = [g for a in d.allocations.values() for g in a]
    assert len(given_out) == len(set(given_out))
    for j in jobs:
        if j.allocation and not j.preemptible:
            assert d.allocations[j.job_id], f"{j.job_id} is not preemptible"


def test_the_simulator_suspends_a_long_job_and_resumes_it_paying_the_restart_overhead():
    trace = [TraceJob("long", 0, 1, 20_000, "imagenet"), TraceJob("short", 3600, 1, 600, "imagenet")]
    overheads = RestartOverheads(inplace_s=5.0)
    plain = {j.job_id: j for j in simulate(trace, ClusterShape(1, 1), "adaptive", overheads=overheads).jobs}
    r = simulate(trace, ClusterShape(1, 1), AdaptivePolicy(suspend=True), overheads=overheads, preemptible=True)
    jobs = {j.job_id: j for j in r.jobs}
    assert jobs["long"].preemptions == 1 and plain["long"].preemptions == 0
    # one restart overhead in all: its trainer holds its GPU while it checkpoints and stops, and the
    # resume pays the rest
    assert jobs["long"].restart_lost_s == pytest.approx(5.0)
    assert jobs["short"].end_s < jobs["long"].end_s
    assert jobs["short"].jct_s < plain["short"].jct_s
    assert r.summary()["avg_jct_s"] < simulate(trace, ClusterShape(1, 1), "adaptive").summary()["avg_jct_s"]
    assert [n for _, job_id, n in r.allocations if job_id == "long"][:3] == [1, 0, 1]


def test_a_job_spanning_gpu_types_is_not_suspended_inside_its_minimum_runtime():
    """Placed on one GPU of each type while the pool ran type-blind, then decided type-aware: each
    type's decision saw it with its GPUs of that type only, fewer than its minimum, and left it at
    zero; the core published that as a suspension 100 s after its start, under a 600 s minimum."""
    nodes = [NodeState("a0", (0, 1), "A"), NodeState("b0", (0, 1), "B")]
    other = JobBook("x", 1, 1, 10**6, 0.0)
    span = JobBook("span", 2, 2, 10**6, 0.0, preemptible=True)
    for book, gpus in ((other, (GpuId("a0", 0),)), (span, (GpuId("a0", 1), GpuId("b0", 0)))):
        book.target = book.in_use = gpus
        book.target_generation = book.acked_generation = 1
    other.last_start_s, span.last_start_s = 0.0, 900.0
    core = SchedulingCore(AdaptivePolicy(suspend=True, min_runtime_s=600.0), 10.0)
    core.rebalance(nodes, [other, span], 1000.0)
    assert span.suspensions_s == () and len(span.target) == 2
    # its GPUs gone (one node out of service), it may be suspended at once
    core.rebalance([nodes[0]], [other, span], 1010.0)
    assert span.suspensions_s == (1010.0,) and span.target == ()
