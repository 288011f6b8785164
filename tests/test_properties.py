"""Property-based tests (hypothesis): no random sequence of operations double-books a GPU.

Invariants checked after every step:

* no GPU is in the in-use set of two jobs, nor in the target of two jobs;
* no GPU published to job X is still in use by another job Y (two-phase protocol);
* in-use and target GPUs never exceed the pool's capacity;
* a running job never holds fewer than its ``min_gpus`` or more than ``max_gpus``;
* an ended job holds no GPU.
"""

from __future__ import annotations

from conftest import FakeClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.policy import get_policy
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, JobState, NodeState
from airflow_elastic_gpu.scheduling.static import StaticPolicy
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.states import JobStatus

NODES = (("n0", 4), ("n1", 2))
CAPACITY = sum(n for _, n in NODES)


class BrokerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.broker = GpuBroker("sqlite://", clock=self.clock)
        for name, n in NODES:
            self.broker.register_node(name, n)
        self.broker.configure_pool(policy_params={"hysteresis": 0.5, "min_resize_interval_s": 5.0},
                                   lease_s=120)
        self.job_ids: list[str] = []
        self.count = 0
        self.published: dict[str, dict[int, set]] = {}  # job -> generation -> its GPUs, as published

    @rule(min_gpus=st.integers(1, 4), extra=st.integers(0, 3), steps=st.integers(1, 5000),
          priority=st.integers(0, 2))
    def submit(self, min_gpus, extra, steps, priority):
        self.count += 1
        job = self.broker.submit(JobSpec(name=f"j{self.count}", command="train", min_gpus=min_gpus,
                                         max_gpus=min_gpus + extra, total_steps=steps,
                                         priority=priority, key=f"k{self.count}",
                                         backend="simulated"))  # may span nodes
        self.job_ids.append(job.id)

    @precondition(lambda self: self.job_ids)
    @rule(data=st.data())
    def ack_current_target(self, data):
        job_id = data.draw(st.sampled_from(self.job_ids))
        self.broker.ack(job_id, self.broker.target(job_id).generation)

    @precondition(lambda self: self.job_ids)
    @rule(data=st.data(), step=st.floats(0, 5000))
    def progress(self, data, step):
        self.broker.progress(data.draw(st.sampled_from(self.job_ids)), step)

    @precondition(lambda self: self.job_ids)
    @rule(data=st.data(), how=st.sampled_from(["finish", "fail", "cancel", "heartbeat"]))
    def end_or_beat(self, data, how):
        job_id = data.draw(st.sampled_from(self.job_ids))
        if how == "finish":
            self.broker.finish(job_id)
        elif how == "fail":
            self.broker.fail(job_id, "property test")
        elif how == "cancel":
            self.broker.cancel(job_id)
        else:
            self.broker.heartbeat(job_id)

    @rule(seconds=st.sampled_from([1.0, 10.0, 200.0]))
    def time_passes_and_rebalance(self, seconds):
        self.clock.advance(seconds)
        self.broker.rebalance()

    @invariant()
    def no_gpu_double_booked(self):
        jobs = self.broker.jobs()
        in_use = [g for j in jobs for g in j.in_use_gpus]
        target = [g for j in jobs for g in j.target_gpus]
        assert len(in_use) == len(set(in_use)) <= CAPACITY
        assert len(target) == len(set(target)) <= CAPACITY
        for x in jobs:
            for y in jobs:
                if x.id != y.id:
                    assert not set(x.target_gpus) & set(y.in_use_gpus), (x.name, y.name)
        # a trainer may run on its acked generation's GPUs and on those of every generation published
        # since (its agent starts it, then acks): no GPU of those is another live trainer's
        maybe_used = {}
        for j in jobs:
            published = self.published.setdefault(j.id, {})
            if j.target_generation:
                published[j.target_generation] = set(j.target_gpus)
            if j.status.terminal and not (j.status is JobStatus.CANCELLED and (j.in_use_gpus or j.target_gpus)):
                continue  # its trainer has stopped (reported, or fenced within the lease)
            maybe_used[j.id] = set(j.in_use_gpus).union(
                *(gpus for generation, gpus in published.items() if generation > j.acked_generation))
        for x, used_x in maybe_used.items():
            for y, used_y in maybe_used.items():
                assert x == y or not used_x & used_y, (x, y, used_x & used_y)
        for j in jobs:
            if j.status is JobStatus.CANCELLED:  # held until its trainer stops: at most a lease
                assert not (j.in_use_gpus or j.target_gpus) or self.clock() - j.last_heartbeat_s <= 120
            elif j.status.terminal:
                assert j.in_use_gpus == () and j.target_gpus == ()
            elif j.target_gpus:
                assert j.min_gpus <= len(j.target_gpus) <= j.max_gpus


TestBrokerMachine = BrokerMachine.TestCase
TestBrokerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw):
    nodes = tuple(NodeState(f"n{i}", tuple(range(draw(st.integers(1, 8)))))
                  for i in range(draw(st.integers(1, 4))))
    free = [GpuId(n.name, i) for n in nodes for i in n.gpu_indices]
    jobs = []
    for k in range(draw(st.integers(0, 10))):
        lo = draw(st.integers(1, 4))
        hi = lo + draw(st.integers(0, 4))
        alloc: tuple[GpuId, ...] = ()
        if draw(st.booleans()):  # a running job on one node, within its bounds
            node = draw(st.sampled_from(nodes))
            mine = [g for g in free if g.node == node.name]
            n = draw(st.integers(0, min(hi, len(mine))))
            if n >= lo:
                alloc = tuple(mine[:n])
                free = [g for g in free if g not in alloc]
        samples = draw(st.lists(st.tuples(st.integers(1, 8), st.floats(0.1, 100)), max_size=3))
        model = ThroughputModel()
        for n_gpus, rate in samples:
            model = model.with_sample(n_gpus, rate)
        jobs.append(JobState(f"j{k}", lo, hi, draw(st.integers(1, 10_000)),
                             steps_done=draw(st.floats(0, 100)), allocation=alloc,
                             last_resize_s=draw(st.one_of(st.none(), st.floats(0, 100))),
                             throughput=model))
    return ClusterState(nodes, tuple(jobs), 100.0)


@settings(max_examples=300, deadline=None)
@given(cluster=clusters(), policy=st.sampled_from([AdaptivePolicy(), AdaptivePolicy(0, 0), StaticPolicy()]))
def test_every_decision_respects_capacity_bounds_and_minimums(cluster, policy):
    d = policy.decide(cluster)
    assert set(d.allocations) == {j.job_id for j in cluster.jobs}
    given_out = [g for a in d.allocations.values() for g in a]
    assert len(given_out) == len(set(given_out)) <= cluster.capacity
    valid = {g for n in cluster.nodes for g in n.gpus()}
    assert set(given_out) <= valid
    for j in cluster.jobs:
        n = len(d.allocations[j.job_id])
        assert n == 0 or j.min_gpus <= n <= max(j.max_gpus, j.num_gpus)
        if j.allocation:
            assert n >= j.min_gpus, f"running job {j.job_id} cut below its minimum"
        if not policy.elastic and j.allocation:
            assert d.allocations[j.job_id] == j.allocation


PEERS = [get_policy(name) for name in ("termination", "optimus", "tiresias", "afs_l")]


@settings(max_examples=200, deadline=None)
@given(cluster=clusters(), policy=st.sampled_from(PEERS))
def test_peer_policies_never_double_book_or_exceed_capacity(cluster, policy):
    d = policy.decide(cluster)
    assert set(d.allocations) == {j.job_id for j in cluster.jobs}
    given_out = [g for a in d.allocations.values() for g in a]
    assert len(given_out) == len(set(given_out)) <= cluster.capacity
    assert set(given_out) <= {g for n in cluster.nodes for g in n.gpus()}
    for j in cluster.jobs:
        n = len(d.allocations[j.job_id])
        assert n == 0 or j.min_gpus <= n
        if j.allocation and not policy.preemptive:
            assert n >= j.min_gpus, f"{policy.name} cut running job {j.job_id} below its minimum"
        if not policy.elastic:  # Tiresias: its request or nothing (preempted / waiting)
            assert n in (0, j.request)
            if n and len(j.allocation) == j.request:
                assert d.allocations[j.job_id] == j.allocation  # a running job keeps its GPUs
