"""Scheduling policies and placement on hand-made clusters (pure functions, no DB)."""

import dataclasses

import pytest

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.policy import get_policy
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, JobState, NodeState
from airflow_elastic_gpu.scheduling.static import StaticPolicy
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel

LINEAR = ThroughputModel(prior_alpha=0.0, prior_steps_per_s=1.0)


def node(name="n0", gpus=4):
    return NodeState(name, tuple(range(gpus)))


def gpus(node_name, *indices):
    return tuple(GpuId(node_name, i) for i in indices)


def job(job_id, *, min_gpus=1, max_gpus=4, steps=1000, done=0, alloc=(), last_resize=None,
        model=LINEAR, overhead=10.0, submit=0.0, requested=None):
    return JobState(job_id, min_gpus, max_gpus, steps, requested_gpus=requested, steps_done=done,
                    submit_time_s=submit, allocation=alloc, last_resize_s=last_resize,
                    restart_overhead_s=overhead, throughput=model)


def no_double_booking(decision):
    used = [g for alloc in decision.allocations.values() for g in alloc]
    return len(used) == len(set(used))


def test_lone_job_gets_every_gpu_it_can_use():
    d = AdaptivePolicy().decide(ClusterState((node(),), (job("a"),), 0.0))
    assert len(d.allocations["a"]) == 4


def test_new_job_is_admitted_by_shrinking_a_running_one():
    a = job("a", alloc=gpus("n0", 0, 1, 2, 3), done=100)
    b = job("b", submit=5.0)
    d = AdaptivePolicy(min_resize_interval_s=0).decide(ClusterState((node(),), (a, b), 100.0))
    assert len(d.allocations["b"]) >= 1
    assert 1 <= len(d.allocations["a"]) < 4
    assert set(d.allocations["a"]) <= set(a.allocation), "a shrink keeps a subset of its GPUs"
    assert no_double_booking(d)
    assert "shrink" in d.reasons["a"]


def test_linear_jobs_are_served_shortest_remaining_first():
    short = job("short", steps=100)
    long = job("long", steps=10_000)
    d = AdaptivePolicy().decide(ClusterState((node(),), (long, short), 0.0))
    assert len(d.allocations["short"]) == 3 and len(d.allocations["long"]) == 1


def test_a_job_that_does_not_scale_gets_no_extra_gpus():
    flat = ThroughputModel().with_sample(1, 10.0).with_sample(2, 10.0)
    d = AdaptivePolicy().decide(ClusterState((node(),), (job("flat", model=flat),), 0.0))
    assert len(d.allocations["flat"]) == 1


def test_growth_smaller_than_restart_overhead_is_not_worth_a_restart():
    # 1 step left at 1 step/s: doubling saves 0.5 s, far below 2 x 10 s overhead
    a = job("a", steps=1001, done=1000, alloc=gpus("n0", 0))
    d = AdaptivePolicy(hysteresis=2.0, min_resize_interval_s=0).decide(
        ClusterState((node(),), (a,), 100.0))
    assert d.allocations["a"] == a.allocation


def test_job_is_not_resized_within_min_resize_interval():
    a = job("a", alloc=gpus("n0", 0), last_resize=90.0)
    d = AdaptivePolicy(min_resize_interval_s=60).decide(ClusterState((node(),), (a,), 100.0))
    assert d.allocations["a"] == a.allocation
    d = AdaptivePolicy(min_resize_interval_s=60).decide(ClusterState((node(),), (a,), 151.0))
    assert len(d.allocations["a"]) == 4


def test_a_job_whose_restart_outlasts_the_interval_keeps_its_allocation_as_long_as_the_restart():
    """A resize is not undone before the job could train as long as it cost: with re-creations of
    300 s and a 60 s interval, two jobs of the termination peer took GPUs from each other 14,533
    times each, neither training, and the simulation never ended."""
    a = job("a", alloc=gpus("n0", 0), last_resize=0.0, overhead=300.0)
    policy = AdaptivePolicy(min_resize_interval_s=60)
    assert policy.decide(ClusterState((node(),), (a,), 61.0)).allocations["a"] == a.allocation
    assert policy.decide(ClusterState((node(),), (a,), 299.0)).allocations["a"] == a.allocation
    assert len(policy.decide(ClusterState((node(),), (a,), 301.0)).allocations["a"]) == 4
    quick = job("a", alloc=gpus("n0", 0), last_resize=0.0, overhead=10.0)
    assert len(policy.decide(ClusterState((node(),), (quick,), 61.0)).allocations["a"]) == 4
    # a measured overhead holds at most max_restart_hold_s (it includes whatever delayed the first
    # step: a pod pending for an hour would have held GPUs better-ranked jobs wait for)
    stuck = job("a", alloc=gpus("n0", 0), last_resize=0.0, overhead=3600.0)
    eager = AdaptivePolicy(min_resize_interval_s=60, hysteresis=0)  # any gain pays such a restart
    assert eager.decide(ClusterState((node(),), (stuck,), 599.0)).allocations["a"] == stuck.allocation
    assert len(eager.decide(ClusterState((node(),), (stuck,), 601.0)).allocations["a"]) == 4
    assert len(AdaptivePolicy(min_resize_interval_s=60, max_restart_hold_s=0).decide(
        ClusterState((node(),), (a,), 61.0)).allocations["a"]) == 4
    # a held job whose GPU is gone (a drain, a GPU out of service) is not held: it restarts anyway
    b = job("b", alloc=gpus("n1", 0, 1, 2), last_resize=0.0, overhead=300.0, submit=1.0)
    shorter = job("c", min_gpus=2, steps=100, submit=2.0)  # ranked first: held, b would keep 3 of 5 GPUs
    moved = policy.decide(ClusterState((node(), NodeState("n1", (3,))), (b, shorter), 100.0)).allocations
    assert (len(moved["b"]), len(moved["c"])) == (1, 4)
    for bad in (-1, True, float("nan")):
        with pytest.raises(ValueError, match="max_restart_hold_s must be a number of seconds >= 0"):
            AdaptivePolicy(max_restart_hold_s=bad)
    # the type-aware hand-out (a pool of two GPU types) keeps its type too, though the other is 4x faster
    typed = (NodeState("v", (0, 1, 2, 3), "V100"), NodeState("k", (0, 1, 2, 3), "K80"))
    on_k80 = dataclasses.replace(job("a", alloc=gpus("k", 0, 1, 2, 3), last_resize=0.0, overhead=300.0,
                                     steps=10_000_000), relative_speed={"V100": 4.0, "K80": 1.0})
    assert policy.decide(ClusterState(typed, (on_k80,), 61.0)).allocations["a"] == on_k80.allocation
    assert {g.node for g in policy.decide(ClusterState(typed, (on_k80,), 301.0)).allocations["a"]} == {"v"}


def test_running_job_is_never_cut_below_its_minimum():
    a = job("a", min_gpus=3, alloc=gpus("n0", 0, 1, 2))
    b = job("b", min_gpus=2, steps=10)
    d = AdaptivePolicy(min_resize_interval_s=0).decide(ClusterState((node(),), (a, b), 0.0))
    assert len(d.allocations["a"]) >= 3
    assert d.allocations["b"] == (), "b waits: only 1 GPU is free and it needs 2"


def test_static_gives_the_request_in_submit_order_with_backfill_and_never_resizes():
    big = job("big", min_gpus=1, max_gpus=4, requested=4, submit=1.0)
    small = job("small", min_gpus=1, max_gpus=1, requested=1, submit=2.0)
    running = job("run", requested=2, alloc=gpus("n0", 0, 1), submit=0.0)
    d = StaticPolicy().decide(ClusterState((node(),), (running, big, small), 10.0))
    assert d.allocations["run"] == running.allocation
    assert d.allocations["big"] == (), "4 GPUs do not fit in the 2 free ones"
    assert len(d.allocations["small"]) == 1, "a later job that fits is started (backfill)"


def test_placement_keeps_a_job_on_one_node():
    nodes = (node("n0", 4), node("n1", 4))
    out = place(nodes, [PlacementRequest("a", 2, 1, gpus("n0", 0)),
                        PlacementRequest("b", 4, 1, ())])
    assert {g.node for g in out["a"]} == {"n0"} and GpuId("n0", 0) in out["a"]
    assert {g.node for g in out["b"]} == {"n1"}


def test_placement_spans_nodes_only_for_jobs_larger_than_a_node():
    nodes = (node("n0", 4), node("n1", 4))
    out = place(nodes, [PlacementRequest("a", 6, 6, ())])
    assert len(out["a"]) == 6 and {g.node for g in out["a"]} == {"n0", "n1"}


def test_placement_gives_nothing_below_min_when_fragmented():
    nodes = (node("n0", 2), node("n1", 2))
    out = place(nodes, [PlacementRequest("x", 1, 1, gpus("n0", 0)),
                        PlacementRequest("y", 1, 1, gpus("n1", 0)),
                        PlacementRequest("z", 2, 2, ())])
    assert out["z"] == ()


def test_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'.*adaptive"):
        get_policy("fifo")
    with pytest.raises(ValueError, match="bad parameters"):
        get_policy("adaptive", nonsense=1)
    with pytest.raises(ValueError, match="hysteresis"):
        get_policy("adaptive", hysteresis=-1)


@pytest.mark.parametrize("kwargs,match", [
    ({"min_gpus": 0}, "min_gpus must be >= 1"),
    ({"min_gpus": 3, "max_gpus": 2}, "max_gpus .* is below min_gpus"),
    ({"requested": 9}, "requested_gpus"),
])
def test_bad_job_state_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        job("x", **kwargs)


def test_a_job_measured_slower_on_more_gpus_is_shrunk_back():
    slower = ThroughputModel().with_sample(1, 100.0).with_sample(4, 20.0)
    a = job("a", steps=100_000, alloc=gpus("n0", 0, 1, 2, 3), model=slower)
    d = AdaptivePolicy(min_resize_interval_s=0).decide(ClusterState((node(),), (a,), 100.0))
    assert len(d.allocations["a"]) < 4
    assert "measured faster on fewer GPUs" in d.reasons["a"]


def test_a_job_a_hair_faster_on_fewer_gpus_gives_up_the_gpus_others_need():
    """Measured as fast on 3 GPUs as on 4 (a hair faster): shrinking it saves it too little to pay
    a restart, so with nobody else it keeps its 4 GPUs; but once a waiting job needs one, the
    shrink serves that job and is made (it was held at 4 before, the newcomer left waiting)."""
    flat = ThroughputModel().with_sample(1, 40.0).with_sample(3, 100.0).with_sample(4, 99.9)
    a = job("a", steps=100_000, alloc=gpus("n0", 0, 1, 2, 3), model=flat, done=10)
    policy = AdaptivePolicy(min_resize_interval_s=0)
    alone = policy.decide(ClusterState((node(),), (a,), 100.0))
    assert len(alone.allocations["a"]) == 4 and "a" not in alone.reasons
    b = job("b", max_gpus=1, steps=1_000, submit=50.0)
    d = policy.decide(ClusterState((node(),), (a, b), 100.0))
    assert len(d.allocations["a"]) == 3 and len(d.allocations["b"]) == 1
    assert no_double_booking(d)



def test_a_job_not_measured_on_a_whole_node_spans_a_second_one_only_up_to_its_request():
    """The prior cannot tell whether a second node helps: an unmeasured job alone on nodes of 4
    gets the whole nodes its request needs (one node for a request of 1); once measured on a whole
    node it may take more."""
    two = (node("n0"), node("n1"))
    policy = AdaptivePolicy()
    d = policy.decide(ClusterState(two, (job("a", max_gpus=8, requested=1),), 0.0))
    assert len(d.allocations["a"]) == 4 and {g.node for g in d.allocations["a"]} == {"n0"}
    d = policy.decide(ClusterState(two, (job("a", max_gpus=8, requested=8),), 0.0))
    assert len(d.allocations["a"]) == 8  # the user's own estimate
    d = policy.decide(ClusterState(two, (job("a", max_gpus=8),), 0.0))
    assert len(d.allocations["a"]) == 8  # no request: max_gpus, as the broker defaults it
    three = (node("n0"), node("n1"), node("n2"))
    d = policy.decide(ClusterState(three, (job("a", max_gpus=12, requested=5),), 0.0))
    assert len(d.allocations["a"]) == 8  # the whole nodes a request of 5 needs, not 5 over two nodes
    measured = ThroughputModel(((1, 1.0), (4, 4.0)), prior_alpha=0.0)  # run on a whole node: linear
    a = job("a", max_gpus=8, requested=1, steps=100_000, alloc=gpus("n0", 0, 1, 2, 3), model=measured)
    d = policy.decide(ClusterState(two, (a,), 1000.0))
    assert len(d.allocations["a"]) == 8 and no_double_booking(d)


@pytest.mark.parametrize("on_two_nodes, expected", [(7.5, 8), (3.0, 4)])
def test_a_job_whose_family_ran_on_two_nodes_knows_whether_a_second_node_helps(on_two_nodes, expected):
    """A scheduled retraining's last run was measured on one node and on two: its next run, not yet
    measured, spreads at once where two nodes were faster, and stays on one where they were slower."""
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    last_run = ThroughputModel(((1, 1.0), (4, 3.9), (8, on_two_nodes)))
    model = with_pool_prior({"a": ThroughputModel()}, {"a": "nightly.train"}, {"nightly.train": last_run})["a"]
    a = job("a", max_gpus=8, requested=1, model=model)
    d = AdaptivePolicy().decide(ClusterState((node("n0"), node("n1")), (a,), 0.0))
    assert len(d.allocations["a"]) == expected


def test_family_samples_steer_a_job_but_only_its_own_measurement_lets_it_explore():
    """A job running on 4 GPUs whose family was measured slower on 8 (two nodes) is brought back
    to 4, and the reason says whose measurement it was; with its own samples only from the family,
    idle GPUs do not make it try a count nobody measured (it was never measured where it runs)."""
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    last_run = ThroughputModel(((1, 1.0), (4, 3.9), (8, 3.0)))
    three = (node("n0"), node("n1"), node("n2"))
    on_4 = ThroughputModel().with_sample(4, 3.9)
    model = with_pool_prior({"a": on_4}, {"a": "nightly.train"}, {"nightly.train": last_run})["a"]
    spread = job("a", max_gpus=12, steps=100_000, alloc=gpus("n0", 0, 1, 2, 3) + gpus("n1", 0, 1, 2, 3), model=model)
    d = AdaptivePolicy().decide(ClusterState(three, (spread,), 1000.0))
    assert len(d.allocations["a"]) == 4
    assert "its family measured faster on fewer GPUs" in d.reasons["a"]
    unmeasured = with_pool_prior({"a": ThroughputModel()}, {"a": "nightly.train"}, {"nightly.train": last_run})["a"]
    on_one = job("a", max_gpus=12, steps=100_000, alloc=gpus("n0", 0, 1, 2, 3), model=unmeasured)
    d = AdaptivePolicy().decide(ClusterState(three, (on_one,), 1000.0))
    assert len(d.allocations["a"]) == 4  # no trial of 12 GPUs on the family's samples alone


MEASURED_LINEAR = ThroughputModel(((1, 1.0), (2, 2.0)), prior_alpha=0.0)  # run on 1 and 2 GPUs: linear
BY_GAIN = AdaptivePolicy(admission_by_gain=True)  # a pool setting, on by default
ADMIT_ALL = AdaptivePolicy(admission_by_gain=False)


def test_a_burst_of_measured_jobs_starts_shortest_first_on_more_gpus():
    """Four waiting jobs of linear scaling, their trainings measured: started one GPU each they would
    share the pool like a processor-sharing queue (every job late); by gain (heSRPT), the shortest
    takes the GPUs first and the others wait for them (the default). With ``admission_by_gain=False``
    all four start."""
    jobs = tuple(job(f"j{i}", steps=1000 * (i + 1), model=MEASURED_LINEAR) for i in range(4))
    d = BY_GAIN.decide(ClusterState((node(),), jobs, 0.0))
    assert len(d.allocations["j0"]) == 4 and not any(d.allocations[f"j{i}"] for i in (1, 2, 3))
    assert "start on 4 GPU(s)" in d.reasons["j0"]
    assert AdaptivePolicy().decide(ClusterState((node(),), jobs, 0.0)).allocations == d.allocations
    everyone = ADMIT_ALL.decide(ClusterState((node(),), jobs, 0.0))
    assert [len(everyone.allocations[f"j{i}"]) for i in range(4)] == [1, 1, 1, 1]


def test_a_job_on_the_makespan_critical_path_starts_at_once():
    """By gain, a long job waits while shorter ones use its GPUs better, unless it is the makespan's
    critical path: at its fastest it needs at least the pool's backlog (every job's remaining work
    on one GPU, over the pool's GPUs), so each second it waits is a second on the last completion."""
    short = job("short", steps=1000, model=MEASURED_LINEAR)
    # 100,000 s at its best (it runs on one GPU at most); backlog (1,000 + 100,000 s) / 4 GPUs
    critical = job("long", max_gpus=1, steps=100_000, model=MEASURED_LINEAR)
    d = BY_GAIN.decide(ClusterState((node(),), (short, critical), 0.0))
    assert len(d.allocations["long"]) == 1 and len(d.allocations["short"]) == 3
    # 25,000 s at its best on 4 GPUs, under the backlog of 25,250 s: the short job goes first
    scalable = job("long", steps=100_000, model=MEASURED_LINEAR)
    d = BY_GAIN.decide(ClusterState((node(),), (short, scalable), 0.0))
    assert d.allocations["long"] == () and len(d.allocations["short"]) == 4
    # measured 1.8x on 2 GPUs (3.0x predicted on 4, 4.5x on 8): 33,333 s at its best on the pool's
    # 4 GPUs, over the backlog, though 8 GPUs (its max_gpus, more than the pool has) would take 22,222 s
    sublinear = job("long", max_gpus=8, steps=100_000, model=ThroughputModel(((1, 1.0), (2, 1.8))))
    d = BY_GAIN.decide(ClusterState((node(),), (short, sublinear), 0.0))
    assert len(d.allocations["long"]) == 1 and len(d.allocations["short"]) == 3


def test_with_admission_min_waiting_a_lone_waiting_job_starts_at_once():
    """``admission_min_waiting=2``: shortest-first admission holds jobs back only while there is an
    order to choose (two or more waiting); a lone waiting job starts at its minimum as by default."""
    a = job("a", steps=2_000, done=0, alloc=gpus("n0", 0, 1), last_resize=0.0, model=MEASURED_LINEAR)
    lone = job("w", steps=6_000, model=MEASURED_LINEAR, submit=900.0)
    cluster = ClusterState((node(),), (a, lone), 1000.0)
    always = AdaptivePolicy(admission_by_gain=True).decide(cluster)
    assert always.allocations["w"] == () and len(always.allocations["a"]) == 4
    two = AdaptivePolicy(admission_by_gain=True, admission_min_waiting=2)
    d = two.decide(cluster)
    assert len(d.allocations["w"]) == 1 and len(d.allocations["a"]) == 3
    burst = tuple(job(f"j{i}", steps=1000 * (i + 1), model=MEASURED_LINEAR) for i in range(4))
    d = two.decide(ClusterState((node(),), burst, 0.0))  # four waiting: shortest first, as always
    assert len(d.allocations["j0"]) == 4 and not any(d.allocations[f"j{i}"] for i in (1, 2, 3))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="admission_min_waiting must be an integer >= 1"):
            AdaptivePolicy(admission_min_waiting=bad)


def test_a_job_ranked_on_a_guess_is_started_at_once_but_not_before_a_measured_shorter_one():
    """A job whose throughput is the pool's guess may be much shorter than it looks: it starts
    at its minimum as soon as GPUs are free (its first progress reports rank it), but only from
    GPUs that the starts of better-ranked measured jobs leave."""
    guess = ThroughputModel(prior_alpha=0.0, prior_steps_per_s=1.0, prior_source="pool")
    short = job("short", steps=1000, model=MEASURED_LINEAR)
    guessed = job("guessed", steps=5000, model=guess)
    d = BY_GAIN.decide(ClusterState((node(),), (short, guessed), 0.0))
    assert len(d.allocations["guessed"]) == 1 and len(d.allocations["short"]) == 3
    whole = job("short", min_gpus=4, steps=1000, model=MEASURED_LINEAR)
    d = BY_GAIN.decide(ClusterState((node(),), (whole, guessed), 0.0))
    assert len(d.allocations["short"]) == 4 and d.allocations["guessed"] == ()


def test_a_long_job_held_back_past_its_patience_is_started_before_any_growth():
    """Shortest-first starts may hold a long job back, but not for longer than ``admission_patience``
    times its own predicted run time on its minimum (by default 1 x 10,000 s; 0.5 x with 0.5)."""
    long = job("long", steps=10_000, model=MEASURED_LINEAR, submit=0.0)
    short = job("short", steps=1000, model=MEASURED_LINEAR, submit=0.0)
    for policy, patience_s in ((BY_GAIN, 10_000.0), (AdaptivePolicy(admission_patience=0.5), 5_000.0)):
        early = policy.decide(ClusterState((node(),), (long, short), patience_s - 1_000.0))
        assert early.allocations["long"] == () and len(early.allocations["short"]) == 4
        late = policy.decide(ClusterState((node(),), (long, short), patience_s + 1_000.0))
        assert len(late.allocations["long"]) == 1 and len(late.allocations["short"]) == 3
    with pytest.raises(ValueError, match="admission_patience must be a number > 0"):
        AdaptivePolicy(admission_patience=0)


def test_a_suspension_never_takes_gpus_set_aside_for_a_better_ranked_start_by_gain():
    """With suspension and ``admission_by_gain`` on: ``a`` (ranked first) is held for step 3 with
    its 3 GPUs set aside; ``b`` (ranked second, needs all 4) may not suspend ``r`` to take them.
    (``r`` may be suspended for ``a``, which then grows onto its GPU: ``a`` is ranked first.)"""
    r = JobState("r", 1, 4, 1_000_000, steps_done=0, allocation=gpus("n0", 0), last_resize_s=0.0,
                 throughput=MEASURED_LINEAR, preemptible=True, last_start_s=0.0, first_start_s=0.0)
    a = job("a", min_gpus=3, steps=300, model=MEASURED_LINEAR, submit=9_990.0)
    b = job("b", min_gpus=4, steps=400, model=MEASURED_LINEAR, submit=9_990.0)
    policy = AdaptivePolicy(suspend=True, admission_by_gain=True, min_runtime_s=0.0, min_resize_interval_s=0.0)
    d = policy.decide(ClusterState((node(),), (r, a, b), 10_000.0))
    assert d.allocations["b"] == () and len(d.allocations["a"]) >= 3
    assert len(d.allocations["a"]) + len(d.allocations["r"]) == 4
    with pytest.raises(ValueError, match="admission_by_gain must be true or false"):
        AdaptivePolicy(admission_by_gain="false")


def test_a_decision_runs_without_the_cyclic_garbage_collector_and_leaves_it_as_it_was(monkeypatch):
    """The collector is paused while the policy decides (a full collection inside a decision at
    2,000 jobs cost 15-25 ms) and on again after it; a caller that paused it keeps it paused."""
    import gc

    seen = []
    inner = AdaptivePolicy._decide
    monkeypatch.setattr(AdaptivePolicy, "_decide", lambda self, c: (seen.append(gc.isenabled()), inner(self, c))[1])
    cluster = ClusterState((NodeState("n0", (0, 1)), NodeState("n1", (0,), "K80")),
                           (JobState("a", 1, 2, 100),), 0.0)
    assert gc.isenabled()
    AdaptivePolicy().decide(cluster)  # two types: the per-type decisions run inside it
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        AdaptivePolicy().decide(cluster)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("flag", ["explore", "suspend", "elastic", "type_aware", "admission_by_gain"])
@pytest.mark.parametrize("bad", [2, 0, "false", None])
def test_a_switch_of_the_adaptive_policy_is_true_or_false_not_a_number_or_text(flag, bad):
    """``pool --param elastic=2`` was stored as 2, and read as true."""
    with pytest.raises(ValueError, match=f"^{flag} must be true or false, got {bad!r}$"):
        AdaptivePolicy(**{flag: bad})


@pytest.mark.parametrize(("field", "bad"), [
    ("hysteresis", True), ("hysteresis", "2"), ("hysteresis", float("nan")), ("min_resize_interval_s", False),
    ("max_restart_hold_s", True), ("min_runtime_s", True), ("min_runtime_s", -1), ("admission_patience", True),
    ("max_suspensions_per_hour", True), ("admission_min_waiting", True),
])
def test_a_number_of_the_adaptive_policy_is_never_a_bool(field, bad):
    """``pool --param hysteresis=true`` was stored as True, which Python reads as 1."""
    with pytest.raises(ValueError, match=f"^{field} must be (a number|an integer)"):
        AdaptivePolicy(**{field: bad})


def test_a_waiting_job_of_a_higher_priority_is_not_outbid_by_a_lower_prioritys_growth():
    """A measured waiting job competed for its start with the growth of running jobs (admission by
    gain), scored by measured speed-ups, which a noisy super-linear sample inflates: the running job
    of a lower priority took the only free GPU. Priority comes first: such a job is admitted at once."""
    low = dataclasses.replace(
        job("low", min_gpus=1, max_gpus=2, steps=10**6, alloc=gpus("n0", 0)),
        throughput=ThroughputModel(((1, 1.0), (2, 5.0))), first_start_s=0.0, last_start_s=0.0)
    high = dataclasses.replace(job("high", min_gpus=1, max_gpus=1, steps=10**4), submit_time_s=900.0, priority=5,
                               throughput=ThroughputModel(((1, 1.0),)))
    cluster = ClusterState((node("n0", 2),), (low, high), 1000.0)
    decision = AdaptivePolicy().decide(cluster)
    assert decision.allocations["high"] == gpus("n0", 1) and decision.allocations["low"] == gpus("n0", 0)
    # of one priority, the start still competes with the growth (admission by gain), also beside a
    # waiting job of a lower priority, whose growth takes nothing
    same = dataclasses.replace(high, priority=0)
    background = dataclasses.replace(job("bg", min_gpus=4, max_gpus=4, steps=10**7), submit_time_s=950.0, priority=-1)
    for jobs in ((low, same), (low, same, background)):
        assert AdaptivePolicy().decide(dataclasses.replace(cluster, jobs=jobs)).allocations["high"] == ()
