"""GPU types: per-type throughput from progress, type-aware allocation, the Gavel peer, mixed clusters."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from airflow_elastic_gpu.broker.models import Job
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec
from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.core import JobBook, gpu_type_of, record_progress
from airflow_elastic_gpu.scheduling.gavel import GavelPolicy, max_sum_allocation
from airflow_elastic_gpu.scheduling.heterogeneous import pool_speed_ratios, type_models
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, JobState, NodeState
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.simulator.engine import ClusterShape, SimulationError, simulate
from airflow_elastic_gpu.simulator.mixed import MixedCluster, load_typed_profiles
from airflow_elastic_gpu.simulator.profiles import load_profiles
from airflow_elastic_gpu.simulator.trace import TraceJob

FAST, SLOW = "V100", "K80"


def nodes(fast=1, slow=1, gpus=4):
    return (tuple(NodeState(f"f{i}", tuple(range(gpus)), FAST) for i in range(fast))
            + tuple(NodeState(f"s{i}", tuple(range(gpus)), SLOW) for i in range(slow)))


def job(job_id, speeds, steps=100_000, alloc=(), **kw):
    """A job measured at 1 GPU on each type of ``speeds`` (type -> steps/s)."""
    kw.setdefault("max_gpus", 4)
    by_type = {t: ThroughputModel(((1, s),), prior_alpha=0.0) for t, s in speeds.items()}
    base = next(iter(by_type.values()))
    return JobState(job_id, 1, total_steps=steps, allocation=tuple(alloc), throughput=base,
                    throughput_by_type=by_type, **kw)


def type_of(gpus, cluster):
    kinds = {n.name: n.gpu_type for n in cluster.nodes}
    return {kinds[g.node] for g in gpus}


def test_a_pool_of_one_type_gets_the_decisions_of_the_type_blind_policy():
    one = tuple(NodeState(f"n{i}", (0, 1, 2, 3), "T4") for i in range(2))
    jobs = tuple(job(str(i), {"T4": 1.0 + i}, steps=1000 * (i + 1)) for i in range(5))
    cluster = ClusterState(one, jobs, 100.0)
    assert AdaptivePolicy().decide(cluster) == AdaptivePolicy(type_aware=False).decide(cluster)


def test_each_job_goes_where_its_relative_speed_up_is_highest():
    cluster = ClusterState(nodes(gpus=1), (job("big-gain", {FAST: 10.0, SLOW: 1.0}),
                                            job("small-gain", {FAST: 1.5, SLOW: 1.0})), 0.0)
    d = AdaptivePolicy().decide(cluster)
    assert type_of(d.allocations["big-gain"], cluster) == {FAST}
    assert type_of(d.allocations["small-gain"], cluster) == {SLOW}


def test_the_relative_speed_hint_places_a_job_before_it_has_run():
    hinted = JobState("j", 1, 1, 1000, relative_speed={FAST: 5.0, SLOW: 1.0})
    other = JobState("k", 1, 1, 1000, relative_speed={FAST: 1.2, SLOW: 1.0})
    cluster = ClusterState(nodes(gpus=1), (hinted, other), 0.0)
    d = AdaptivePolicy().decide(cluster)
    assert type_of(d.allocations["j"], cluster) == {FAST}


def test_a_type_not_run_on_is_predicted_from_the_pool_measured_ratio_without_a_hint():
    both = job("both", {FAST: 8.0, SLOW: 2.0})
    once = JobState("once", 1, 4, 1000, throughput_by_type={SLOW: ThroughputModel(((1, 3.0),))})
    models = type_models(once, (FAST, SLOW), pool_speed_ratios([both, once]))
    assert models[FAST].steps_per_s(1) == pytest.approx(4 * models[SLOW].steps_per_s(1))


def test_a_running_job_stays_on_its_type_when_moving_does_not_pay_its_restart():
    cluster = nodes(fast=1, slow=1, gpus=1)
    near_done = job("j", {FAST: 10.0, SLOW: 9.0}, steps=100, alloc=[GpuId("s0", 0)],
                    restart_overhead_s=60.0, last_resize_s=0.0)
    d = AdaptivePolicy().decide(ClusterState(cluster, (near_done,), 1000.0))
    assert d.allocations["j"] == (GpuId("s0", 0),)


def test_a_running_job_moves_to_a_free_faster_type_when_it_pays():
    cluster = nodes(fast=1, slow=1, gpus=1)
    long_job = job("j", {FAST: 10.0, SLOW: 1.0}, steps=1_000_000, alloc=[GpuId("s0", 0)],
                   restart_overhead_s=10.0, last_resize_s=0.0)
    d = AdaptivePolicy().decide(ClusterState(cluster, (long_job,), 1000.0))
    assert d.allocations["j"] == (GpuId("f0", 0),)
    assert "move K80->V100" in d.reasons["j"]


def test_a_running_job_is_not_moved_to_a_faster_type_that_has_room_only_for_its_minimum():
    """Four K80s are not left for one V100 that is a little faster per GPU: the move must pay at the
    count the new type has room for (here one GPU, which its hand-out then gave it)."""
    cluster = nodes(fast=1, slow=1, gpus=4)
    linear = {t: ThroughputModel(((1, s), (4, 4 * s)), prior_alpha=0.0) for t, s in ((FAST, 1.2), (SLOW, 1.0))}
    on_slow = JobState("j", 1, 4, 1_000_000, allocation=tuple(GpuId("s0", i) for i in range(4)),
                       last_resize_s=0.0, restart_overhead_s=10.0, throughput=linear[SLOW], throughput_by_type=linear)
    # three longer jobs hold three of the four V100s (ranked after j, they keep their minimum)
    others = tuple(job(f"long{i}", {FAST: 1.0, SLOW: 1.0}, steps=10_000_000, alloc=[GpuId("f0", i)],
                       last_resize_s=0.0) for i in range(3))
    d = AdaptivePolicy().decide(ClusterState(cluster, (on_slow, *others), 1000.0))
    assert d.allocations["j"] == on_slow.allocation
    # with the V100s free, the same job moves: there it keeps its count and runs 1.2x faster
    d = AdaptivePolicy().decide(ClusterState(cluster, (on_slow,), 1000.0))
    assert type_of(d.allocations["j"], ClusterState(cluster, (), 0.0)) == {FAST}
    assert "move K80->V100, 4->4 GPU(s)" in d.reasons["j"]


def test_a_running_job_leaves_one_gpu_of_a_crowded_type_for_idle_gpus_of_another_when_that_is_faster():
    """One V100 (2 steps/s) against four idle K80s (1 step/s each, linear): the move pays at the
    four GPUs idle there, not at the one GPU it holds (at one GPU each way it would never move)."""
    cluster = nodes(fast=1, slow=1, gpus=4)
    linear = {t: ThroughputModel(((1, s), (4, 4 * s)), prior_alpha=0.0) for t, s in ((FAST, 2.0), (SLOW, 1.0))}
    crowded = JobState("j", 1, 4, 1_000_000, allocation=(GpuId("f0", 3),), last_resize_s=0.0,
                       restart_overhead_s=10.0, throughput=linear[FAST], throughput_by_type=linear)
    # three shorter jobs that run 10x faster on the V100s hold the other three
    others = tuple(job(f"v{i}", {FAST: 10.0, SLOW: 1.0}, steps=2_500_000, alloc=[GpuId("f0", i)], max_gpus=1,
                       last_resize_s=0.0) for i in range(3))
    d = AdaptivePolicy().decide(ClusterState(cluster, (crowded, *others), 1000.0))
    assert d.allocations["j"] == tuple(GpuId("s0", i) for i in range(4))
    assert "move V100->K80, 1->4 GPU(s)" in d.reasons["j"]
    assert all(d.allocations[o.job_id] == o.allocation for o in others)


def _short_arrives_at_a_full_fast_type(long_resized_s=0.0, slow_held=False):
    """A 1-GPU V100 node held by a long job at its minimum, a 1-GPU K80 node (free unless
    ``slow_held``: a job resized just now holds it), and a short job that arrives."""
    cluster = nodes(fast=1, slow=1, gpus=1)
    long_job = job("long", {FAST: 2.0, SLOW: 1.0}, steps=10_000_000, alloc=[GpuId("f0", 0)], max_gpus=1,
                   last_resize_s=long_resized_s)
    short = job("short", {FAST: 10.0, SLOW: 1.0}, steps=10_000, max_gpus=1)
    jobs = [long_job, short]
    if slow_held:
        jobs.append(job("other", {FAST: 1.0, SLOW: 1.0}, steps=20_000_000, alloc=[GpuId("s0", 0)],
                        max_gpus=1, last_resize_s=999.0))
    return ClusterState(cluster, tuple(jobs), 1000.0)


def test_a_waiting_job_displaces_a_later_ranked_one_from_its_best_type_to_another_with_room():
    """Shortest first across types: the short job takes the V100 that the long job held at its
    minimum; the long job keeps running, moved to the free K80."""
    d = AdaptivePolicy().decide(_short_arrives_at_a_full_fast_type())
    assert d.allocations["short"] == (GpuId("f0", 0),)
    assert d.allocations["long"] == (GpuId("s0", 0),)
    assert "move V100->K80, 1->1 GPU(s)" in d.reasons["long"]
    assert "its V100 GPUs go to jobs ranked before it" in d.reasons["long"]


@pytest.mark.parametrize(("why", "case", "short_gets"), [
    ("it was resized within the interval", {"long_resized_s": 990.0}, (GpuId("s0", 0),)),  # the K80 is free
    ("no other type has room for it", {"slow_held": True}, ()),  # the short job waits
])
def test_a_running_job_is_not_displaced_when(why, case, short_gets):
    d = AdaptivePolicy().decide(_short_arrives_at_a_full_fast_type(**case))
    assert d.allocations["long"] == (GpuId("f0", 0),), why
    assert d.allocations["short"] == short_gets


def test_displacement_takes_the_worst_ranked_jobs_first_and_all_or_nothing():
    """Two V100s held at their minimum by three jobs ranked after a 2-GPU waiting job (one of them
    resized just now), four K80s with room for two: the two worst-ranked movable ones go to the
    K80s; with room for one only, nobody moves and the waiting job waits."""
    cluster = (NodeState("f0", (0, 1, 2), FAST), NodeState("s0", (0, 1), SLOW))
    held = [job(f"long{i}", {FAST: 2.0, SLOW: 1.0}, steps=10_000_000 * (i + 1), alloc=[GpuId("f0", i)],
                max_gpus=1, last_resize_s=999.0 if i == 2 else 0.0) for i in range(3)]
    short = JobState("short", 2, 2, 10_000, throughput_by_type={FAST: ThroughputModel(((1, 10.0), (2, 20.0))),
                                                                SLOW: ThroughputModel(((1, 1.0), (2, 2.0)))},
                     throughput=ThroughputModel(((1, 10.0), (2, 20.0))))
    d = AdaptivePolicy().decide(ClusterState(cluster, (short, *held), 1000.0))
    kinds = {n.name: n.gpu_type for n in cluster}
    on = {job_id: {kinds[g.node] for g in gpus} for job_id, gpus in d.allocations.items()}
    # long2 (worst-ranked) was resized just now: it stays; long1 and long0 move, worst first
    assert on == {"short": {FAST}, "long0": {SLOW}, "long1": {SLOW}, "long2": {FAST}}
    assert all("go to jobs ranked before it" in d.reasons[j] for j in ("long0", "long1"))
    # one K80 only: room for one displaced job is not room enough for a 2-GPU start
    one_slow = (NodeState("f0", (0, 1, 2), FAST), NodeState("s0", (0,), SLOW))
    d = AdaptivePolicy().decide(ClusterState(one_slow, (short, *held), 1000.0))
    assert d.allocations["short"] == ()
    assert all(d.allocations[j.job_id] == j.allocation for j in held)


def test_no_displacement_when_the_type_with_room_is_nearly_as_fast():
    """The waiting job runs almost as fast on the free K80 as on the V100 the long job holds: moving
    the long job would cost its restart for next to nothing."""
    cluster = nodes(fast=1, slow=1, gpus=1)
    long_job = job("long", {FAST: 2.0, SLOW: 1.0}, steps=10_000_000, alloc=[GpuId("f0", 0)], max_gpus=1,
                   last_resize_s=0.0, restart_overhead_s=60.0)
    short = job("short", {FAST: 1.0, SLOW: 0.999}, steps=10_000, max_gpus=1)
    d = AdaptivePolicy().decide(ClusterState(cluster, (long_job, short), 1000.0))
    assert d.allocations == {"long": (GpuId("f0", 0),), "short": (GpuId("s0", 0),)}


def test_a_model_taken_from_another_type_predicts_on_this_type_s_node_size():
    """Measured on 8-GPU V100 nodes (linear to 4, less on 8, more on 16 over two nodes), predicted
    on K80 nodes of 4: the K80 model fits 1-4 GPUs to the samples up to 4 (linear), the V100 one
    1-8 to the samples up to 8 (bent by the 8-GPU sample)."""
    v100 = ThroughputModel(((1, 10.0), (2, 20.0), (4, 40.0), (8, 50.0), (16, 60.0)), node_gpus=8)
    j = JobState("j", 1, 16, 1000, throughput=v100, throughput_by_type={FAST: v100},
                 relative_speed={FAST: 2.0, SLOW: 1.0})
    models = type_models(j, (FAST, SLOW), {}, {FAST: 8, SLOW: 4})
    assert models[FAST] is v100 and models[SLOW].node_gpus == 4
    assert models[SLOW].steps_per_s(3) == pytest.approx(15.0)  # linear on one K80 node, at half the V100's pace
    assert models[FAST].steps_per_s(3) < 30.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 20), st.floats(0.5, 20), st.integers(1, 8), st.booleans()),
                min_size=1, max_size=12),
       st.integers(1, 3), st.integers(1, 3))
def test_no_job_is_split_across_types_and_no_gpu_is_given_twice(specs, fast, slow):
    cluster_nodes = nodes(fast, slow, gpus=4)
    jobs, free = [], [g for n in cluster_nodes for g in n.gpus()]
    for i, (f, s, max_gpus, running) in enumerate(specs):
        alloc = (free.pop(0),) if running and free else ()
        jobs.append(job(str(i), {FAST: f, SLOW: s}, max_gpus=max_gpus, alloc=alloc, last_resize_s=0.0))
    cluster = ClusterState(cluster_nodes, tuple(jobs), 1000.0)
    for policy in (AdaptivePolicy(), GavelPolicy()):
        d = policy.decide(cluster)
        given_out = [g for gpus in d.allocations.values() for g in gpus]
        assert len(given_out) == len(set(given_out))
        assert all(len(type_of(gpus, cluster)) <= 1 for gpus in d.allocations.values())
        if not policy.preemptive:
            assert all(d.allocations[j.job_id] for j in jobs if j.allocation)


def test_a_progress_sample_is_also_learnt_for_the_gpu_type_it_ran_on():
    book = JobBook("j", 1, 4, 1000, 0.0, target=(GpuId("f0", 0),), target_generation=1, acked_generation=1)
    node_types = {"f0": FAST, "s0": SLOW}
    kind = gpu_type_of(book.gpus_of(1), node_types)
    record_progress(book, generation=1, step=0, now_s=0.0, previous=None, gpu_type=kind)
    record_progress(book, generation=1, step=50, now_s=10.0, previous=(0.0, 0), gpu_type=kind)
    assert book.throughput_by_type[FAST].observed == ((1, 5.0),)
    assert book.throughput.observed == ((1, 5.0),)
    assert gpu_type_of((GpuId("f0", 0), GpuId("s0", 0)), node_types) is None


def test_the_broker_learns_per_type_throughput_and_keeps_the_hint(broker, clock):
    broker.register_node("f0", 2, gpu_type=FAST)
    broker.register_node("s0", 2, gpu_type=SLOW)
    a = broker.submit(JobSpec(name="a", command="train", key="a", max_gpus=2, total_steps=10_000,
                              relative_speed={FAST: 4.0, SLOW: 1.0}))
    broker.ack(a.id, 1)
    for step in (0, 100):
        broker.progress(a.id, step, generation=1)
        clock.advance(10)
    with broker.engine.connect() as conn:
        stored = conn.execute(select(Job.throughput).where(Job.id == a.id)).scalar_one()
    (kind,) = {FAST if g.node == "f0" else SLOW for g in broker.job(a.id).in_use_gpus}
    assert stored["by_type"] == {kind: [[2, pytest.approx(10.0)]]}
    assert stored["relative_speed"] == {FAST: 4.0, SLOW: 1.0}


@pytest.mark.parametrize("bad", [[1, 2], {"V100": 0}, {"V100": float("nan")}, {"": 1.0}, {"V100": True}])
def test_a_bad_relative_speed_hint_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequest, match="relative_speed"):
        JobSpec(name="a", command="train", relative_speed=bad)


def test_max_sum_allocation_matches_brute_force_on_whole_assignments():
    value = [{FAST: 1.0, SLOW: 0.2}, {FAST: 1.0, SLOW: 0.9}, {FAST: 1.0, SLOW: 0.5}]
    x = max_sum_allocation(value, [1, 1, 1], {FAST: 1, SLOW: 1})
    best = max(value[a][FAST] + value[b][SLOW] for a, b in itertools.permutations(range(3), 2))
    assert sum(value[j][t] * f for j, xj in enumerate(x) for t, f in xj.items()) == pytest.approx(best)


def test_mixed_cluster_spec_parses_into_typed_nodes_and_rejects_garbage():
    c = MixedCluster.parse("2x4:V100,1x8:K80")
    assert c.capacity == 16 and c.gpu_types == ("V100", "K80") and str(c) == "2x4:V100,1x8:K80"
    assert [n.gpu_type for n in c.node_states()] == ["V100", "V100", "K80"]
    with pytest.raises(SimulationError, match="NODESxGPUS:TYPE"):
        MixedCluster.parse("2x4:V100,K80")


def test_a_job_on_gpus_of_two_types_trains_at_the_slowest_pace():
    c = MixedCluster.parse("1x1:V100,1x1:K80")
    prof = load_typed_profiles(c)["ResNet-18 (batch size 64)"]
    names = [n.name for n in c.node_states()]
    mixed = prof.speed_on((GpuId(names[0], 0), GpuId(names[1], 0)))
    assert mixed == pytest.approx(min(p.samples_per_s(2, 2) for p in prof.profiles.values()))
    assert mixed < prof.profiles["V100"].samples_per_s(2, 2)


def test_a_mixed_cluster_simulation_finishes_every_job():
    c = MixedCluster.parse("1x4:A100,1x4:T4")
    trace = [TraceJob(str(i), 600.0 * i, 1 + i % 4, 1800.0, model=m)
             for i, m in enumerate(["bert", "imagenet", "deepspeech2", "cifar10"] * 2)]
    r = simulate(trace, c, "adaptive")
    assert all(j.end_s is not None for j in r.jobs)
    assert r.summary()["cluster"] == "1x4:A100,1x4:T4"
    single = simulate(trace[:2], ClusterShape(1, 4), "adaptive")
    assert all(j.end_s is not None for j in single.jobs)


def test_a_jobs_ideal_run_time_on_a_mixed_cluster_uses_only_the_gpus_each_type_has():
    """The ideal run time (slowdown, finish-time fairness) took the best of every type at up to the
    whole cluster's GPU count (16 T4 on a cluster of 8), while the per-count speeds and the makespan
    bound took the reference type's only: slowdown was inflated, and the bounds disagreed."""
    c = MixedCluster.parse("2x4:A100,2x4:T4")
    profiles = load_typed_profiles(c)
    trace = [TraceJob(f"{m}-{i}", 900.0 * i, 4, 3600.0, model=m)
             for i, m in enumerate(["imagenet", "deepspeech2", "bert", "cifar10"])]
    for policy in ("adaptive", "static", "gavel"):
        r = simulate(trace, c, policy)
        for j, (_, rho) in zip(r.jobs, r.fairness()):
            typed = profiles[j.model]
            on_one_type = max(p.samples_per_s(n, -(-n // 4)) for p in typed.profiles.values() for n in range(1, 9))
            assert j.best_speeds[-1] == pytest.approx(max(on_one_type, typed.speeds_by_count(16, c.type_sizes())[-1]))
            assert j.slowdown >= 1 - 1e-9 and rho <= j.slowdown + 1e-9, (policy, j.job_id)
    # 16 GPUs of two types train at the slower type's pace: never above what one type gives on its 8
    typed = profiles["imagenet"]
    speeds = typed.speeds_by_count(16, c.type_sizes())
    assert speeds[15] == pytest.approx(min(p.samples_per_s(16, 4) for p in typed.profiles.values()))
    assert speeds[7] == pytest.approx(max(p.samples_per_s(8, 2) for p in typed.profiles.values()))
    # one type's profiles on a cluster of several groups (every type as fast) still run
    single = simulate(trace[:1], MixedCluster.parse("1x4:T4,1x4:T4"), "adaptive", profiles=load_profiles())
    assert single.jobs[0].slowdown >= 1 - 1e-9


def test_a_job_moved_to_another_type_is_admitted_there_when_starts_go_by_gain():
    """With ``admission_by_gain`` (the default), a waiting job's start competes with growth; a
    running job that moves type holds no GPU of its new type yet, but it is running: it is admitted
    there at once, not left without GPUs behind a shorter job's growth (and the type choice redone)."""
    cluster = nodes(fast=1, slow=1, gpus=4)
    short = job("short", {FAST: 10.0, SLOW: 1.0}, steps=10_000)
    for history in ({}, {"first_start_s": 0.0, "suspensions_s": (500.0,)}):  # started unknown; resumed once
        mover = job("mover", {FAST: 10.0, SLOW: 1.0}, steps=1_000_000, alloc=[GpuId("s0", 0)],
                    restart_overhead_s=10.0, last_resize_s=0.0, **history)
        for policy in (AdaptivePolicy(admission_by_gain=False), AdaptivePolicy()):
            state = ClusterState(cluster, (mover, short), 1000.0)
            d = policy.decide(state)
            assert type_of(d.allocations["mover"], state) == {FAST}, (policy, history)
            assert d.allocations["short"], (policy, history)


def test_a_drained_node_or_a_type_with_no_healthy_gpu_does_not_stop_the_decision():
    """A job runs on the one T4 node; that node is drained (gone from the decision's nodes), or its
    GPUs all turn unhealthy (its type has nothing to hand out): the decision goes on, and the job
    is placed on the GPUs there are, of one type."""
    nodes = (NodeState("v", (0, 1), "V100"), NodeState("k", (0, 1), "K80"))
    running = JobState("j", 1, 2, 10_000, steps_done=100, allocation=(GpuId("t", 0), GpuId("t", 1)),
                       throughput=ThroughputModel(((2, 2.0),)), last_resize_s=0.0, restart_overhead_s=5.0)
    other = JobState("o", 1, 2, 1000, allocation=(GpuId("v", 0),), throughput=ThroughputModel(((1, 1.0),)),
                     last_resize_s=0.0, restart_overhead_s=5.0)
    for pool in (nodes, (*nodes, NodeState("t", (), "T4"))):
        d = AdaptivePolicy().decide(ClusterState(pool, (running, other), 1000.0))
        assert d.allocations["j"] and len({g.node for g in d.allocations["j"]}) == 1, d.allocations
        assert {g.node for g in d.allocations["j"]} <= {"v", "k"}


def test_the_pool_s_speed_ratios_count_jobs_measured_on_both_types_not_their_families():
    """One job measured on V100 (10 steps/s) and K80 (5); five queued runs of a family whose last
    run read 10 and 1 carry that run's samples as a prior: the pool's ratio stays the measured one."""
    from airflow_elastic_gpu.scheduling.throughput import with_family_by_type

    measured = JobState("m", 1, 1, 100, throughput_by_type={"V100": ThroughputModel(((1, 10.0),)),
                                                             "K80": ThroughputModel(((1, 5.0),))})
    last = {"V100": ThroughputModel(((1, 10.0),)), "K80": ThroughputModel(((1, 1.0),))}
    priors = with_family_by_type({f"q{i}": {} for i in range(5)}, dict.fromkeys([f"q{i}" for i in range(5)], "f"),
                                 {"f": last})
    queued = [JobState(job_id, 1, 1, 100, throughput_by_type=by_type) for job_id, by_type in priors.items()]
    assert all(len(j.throughput_by_type) == 2 for j in queued)
    assert pool_speed_ratios([measured, *queued])[("V100", "K80")] == pytest.approx(0.5)


def test_guesses_that_land_on_one_time_go_to_the_fast_type_by_submit_time():
    """The type choice ranks as the policy does: two jobs guessed at the same remaining time (400 s,
    worked out through different speeds, so apart in the last bits of a float) are taken by submit
    time, and the earlier one gets the one fast GPU."""
    nodes = (NodeState("v", (0,), "V100"), NodeState("k", (0,), "K80"))

    def job(name: str, steps: int, submit_s: float) -> JobState:
        return JobState(name, 1, 1, steps, submit_time_s=submit_s, relative_speed={"V100": 2.0, "K80": 1.0},
                        throughput=ThroughputModel(prior_steps_per_s=steps / 400.0))

    late, early = job("late", 1_000_012, 5.0), job("early", 1_000_013, 1.0)
    decided = AdaptivePolicy().decide(ClusterState(nodes, (late, early), 10.0))
    assert decided.allocations["early"] == (GpuId("v", 0),)
    assert decided.allocations["late"] == (GpuId("k", 0),)


def test_the_gavel_peer_decides_on_a_pool_without_gpus_and_off_gpus_taken_out_of_service():
    """An empty pool divided by zero; a job inside its round on a node whose GPUs were all taken out
    of service was kept on a type the pool no longer had (KeyError); a job of min_gpus 2 got 1."""
    running = JobState("run", 1, 2, total_steps=1000, submit_time_s=0.0, allocation=(GpuId("a0", 1),),
                       last_resize_s=990.0, first_start_s=0.0)
    pair = JobState("pair", 2, 2, total_steps=1000, submit_time_s=5.0, requested_gpus=2)
    policy = GavelPolicy()
    assert policy.decide(ClusterState((NodeState("a0", (), "A"),), (running,), 1000.0)).allocations == {"run": ()}
    nodes = (NodeState("a0", (), "A"), NodeState("b0", (0, 1), "B"))
    decided = policy.decide(ClusterState(nodes, (running, pair), 1000.0)).allocations
    assert {g.node for g in decided["run"]} <= {"b0"}
    assert decided["pair"] in ((), (GpuId("b0", 0), GpuId("b0", 1)))
    assert not (set(decided["run"]) & set(decided["pair"]))
    one = (NodeState("b0", (0,), "B"),)  # fewer GPUs of any type than its minimum: it waits
    assert policy.decide(ClusterState(one, (pair,), 1000.0)).allocations == {"pair": ()}
