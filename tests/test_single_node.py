"""A job whose command cannot run on several nodes (no gang placeholders) is never spread over
them, whatever the pool's GPUs do: its backend cannot run such a target (Kubernetes raised "spans
nodes" at every poll; the local backend would run a trainer per node)."""

from __future__ import annotations

import pytest
from conftest import RESIZE_AT_ONCE

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec


@pytest.fixture
def broker(tmp_path, clock):
    b = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}", clock=clock)
    b.register_node("n0", 4)
    b.register_node("n1", 4)
    b.configure_pool(policy_params=RESIZE_AT_ONCE)
    yield b
    b.engine.dispose()


def nodes_of(broker, job_id) -> set[str]:
    return {g.node for g in broker.job(job_id).target_gpus}


def test_a_job_whose_minimum_no_node_has_any_more_keeps_its_node(broker, clock):
    """4..4 GPUs on 4-GPU nodes, then GPU 3 of each out of service: it was given n0:0-2 + n1:0."""
    job = broker.submit(JobSpec("one-node", "python t.py --gpus {num_gpus}", 4, 4, total_steps=10, backend="local"))
    broker.rebalance()
    broker.ack(job.id, broker.job(job.id).target_generation)
    (home,) = nodes_of(broker, job.id)
    for node in ("n1", "n0"):
        broker.set_gpus_healthy(node, [3], False)
    clock.advance(10)
    broker.rebalance()
    assert nodes_of(broker, job.id) == {home} and len(broker.job(job.id).target_gpus) == 4
    with pytest.raises(InvalidRequest, match="larger than any node"):  # a new one is refused at submit
        broker.submit(JobSpec("later", "python t.py", 4, 4, total_steps=10, backend="local"))


def test_a_job_is_not_spread_over_gpus_that_other_jobs_still_drain(broker, clock):
    """GPUs of jobs just cancelled are held until their trainers stop: a node's free GPUs are fewer
    than its healthy ones for that while, and a target up to the node size was spread."""
    broker.set_node_schedulable("n1", False)
    y = broker.submit(JobSpec("Y", "python y.py", 2, 2, total_steps=100, backend="local"))
    x = broker.submit(JobSpec("X", "python x.py --gpus {num_gpus}", 1, 4, total_steps=100, backend="local"))
    broker.rebalance()
    for j in (x, y):
        broker.ack(j.id, broker.job(j.id).target_generation)
    broker.set_gpus_healthy("n1", [3], False)
    broker.set_node_schedulable("n1", True)
    z = broker.submit(JobSpec("Z", "python z.py", 1, 1, total_steps=100, backend="local", priority=10))
    broker.rebalance()
    for j in (x, y, z):
        if broker.job(j.id).target_generation > broker.job(j.id).acked_generation:
            broker.ack(j.id, broker.job(j.id).target_generation)
    broker.cancel(y.id, "done with it")
    broker.cancel(z.id, "done with it")
    clock.advance(1)
    broker.rebalance()
    assert len(nodes_of(broker, x.id)) == 1


def test_placeholders_in_another_case_do_not_make_a_command_a_gangs(broker_url, clock):
    """SQLite's LIKE ignores ASCII case: ``{NNODES}`` counted as ``{nnodes}``, and the rebalance
    could spread a command the launcher cannot shape for several nodes over them."""
    from sqlalchemy import select

    from airflow_elastic_gpu.broker.models import Job
    from airflow_elastic_gpu.broker.rebalance import _MULTI_NODE

    b = GpuBroker(broker_url, clock=clock)
    try:
        b.register_node("n0", 4)
        gang = "torchrun --nnodes={nnodes} --node_rank={node_rank} --rdzv_endpoint={master_addr}:{master_port}"
        names = {"upper": gang.upper(), "gang": gang, "one-missing": gang.replace("{node_rank}", "0"),
                 "like-wildcards": "torchrun --nnodes=_nnodes% --node_rank=_node_rank% %master_addr%:%master_port%"}
        for name, command in names.items():
            b.submit(JobSpec(name, command, 1, 4, total_steps=10, backend="local"))
        with b.engine.connect() as db:
            multi = dict(db.execute(select(Job.name, _MULTI_NODE)).all())
        assert multi == {"upper": False, "gang": True, "one-missing": False, "like-wildcards": False}
    finally:
        b.engine.dispose()


def test_a_waiting_job_that_no_node_can_hold_leaves_the_pool_to_the_others():
    """Nodes of 2 + 2 GPUs and a one-node job of 3 or more waiting (the nodes lost GPUs since its
    submit): the policy counted 3 GPUs for it, their spread over two nodes was refused, and those
    GPUs went to no job, decision after decision, while an elastic job could use them."""
    from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore, apply_ack
    from airflow_elastic_gpu.scheduling.policy import get_policy
    from airflow_elastic_gpu.scheduling.state import NodeState

    nodes = [NodeState("n0", (0, 1)), NodeState("n1", (0, 1))]
    core = SchedulingCore(get_policy("adaptive", hysteresis=0.0, min_resize_interval_s=0.0), 10.0)
    waiting = JobBook("one-node", 3, 4, 1000, 0.0)
    waiting.single_node = True
    elastic = JobBook("elastic", 1, 4, 10**6, 1.0)
    for now in (10.0, 100.0, 1000.0, 5000.0):
        core.rebalance(nodes, [waiting, elastic], now)
        for book in (waiting, elastic):
            if book.target_generation > book.acked_generation:
                apply_ack(book, book.target_generation, now)
    assert waiting.target == () and len(elastic.target) == 4
