"""Per-node acks of a gang with one agent per node (a pod per node on Kubernetes), on SQLite and
PostgreSQL: the job's in-use set moves only once every node of its old and new GPUs has acked the
target generation, so that no GPU is freed while a trainer of the job still runs on it."""

from __future__ import annotations

import threading

import pytest
from conftest import RESIZE_AT_ONCE
from fastapi.testclient import TestClient

from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec
from airflow_elastic_gpu.states import EventKind, JobStatus

GANG = "torchrun --nnodes={nnodes} --node_rank={node_rank} --rdzv_endpoint={master_addr}:{master_port} train.py"
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture
def pool(broker):
    for node in NODES:
        broker.register_node(node, 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    return broker


def gang(broker, lo=6, hi=6, name="gang"):
    return broker.submit(JobSpec(name, GANG, lo, hi, total_steps=1000, backend="kubernetes"))


def nodes_of(gpus):
    return sorted({g.node for g in gpus})


def test_a_generation_is_acked_only_once_every_node_has_acked_it(pool):
    broker = pool
    job = gang(broker)
    target = broker.target(job.id)
    assert target.generation == 1 and nodes_of(target.gpus) == list(NODES)
    assert broker.ack(job.id, 1, node="node-a") is True
    assert broker.ack(job.id, 1, node="node-a") is True  # a retry: recorded again, nothing more
    assert broker.ack(job.id, 1, node="node-b") is True
    half = broker.job(job.id)
    assert half.acked_generation == 0 and half.in_use_gpus == ()  # node-c's trainer does not run yet
    assert broker.ack(job.id, 1, node="node-c") is True
    done = broker.job(job.id)
    assert done.acked_generation == 1 and done.in_use_gpus == target.gpus
    assert broker.ack(job.id, 1, node="node-a") is False  # already acked
    acks = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.ACK.value]
    assert len(acks) == 1


def test_a_dropped_node_must_ack_before_its_gpus_go_to_another_job(pool):
    broker = pool
    job = gang(broker, lo=4, hi=6)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    other = broker.submit(JobSpec("other", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    target = broker.target(job.id)
    assert target.generation == 2 and len(nodes_of(target.gpus)) == 2  # the gang shrinks to two nodes
    (dropped,) = set(NODES) - set(nodes_of(target.gpus))
    assert broker.ack(job.id, 1, node=dropped) is False  # a late ack of the older generation: ignored
    for node in nodes_of(target.gpus):
        broker.ack(job.id, 2, node=node)
    mid = broker.job(job.id)
    assert mid.acked_generation == 1 and len(mid.in_use_gpus) == 6  # the dropped node's trainer may still run
    assert broker.job(other.id).target_gpus == ()  # so its GPUs are not published to anyone
    assert broker.ack(job.id, 2, node=dropped) is True  # its agent stopped the trainer (suspended)
    after = broker.job(job.id)
    assert after.acked_generation == 2 and after.in_use_gpus == target.gpus
    assert nodes_of(broker.job(other.id).target_gpus) == [dropped]


def test_a_failure_reported_by_a_node_the_gang_no_longer_runs_on_does_not_end_it(pool):
    """The dropped node's pod is deleted once every node has acked the smaller gang; its trainer (or
    a restarted agent that took the deletion for a stop from outside) reports a failure then: the
    whole job failed, though nothing of it ran on that node any more."""
    broker = pool
    job = gang(broker, lo=4, hi=6)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    broker.submit(JobSpec("other", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    target = broker.target(job.id)
    (dropped,) = set(NODES) - set(nodes_of(target.gpus))
    for node in NODES:
        broker.ack(job.id, 2, node=node)
    assert broker.job(job.id).in_use_gpus == target.gpus
    after = broker.fail(job.id, "the launcher was stopped from outside the broker", node=dropped)
    assert after.status is JobStatus.RUNNING and after.in_use_gpus == target.gpus
    kept = nodes_of(target.gpus)[0]  # a node it runs on: the job's end, as before
    assert broker.fail(job.id, "trainer exited with code 1", node=kept).status is JobStatus.FAILED


def test_an_ack_of_a_node_without_the_jobs_gpus_is_rejected(pool):
    broker = pool
    job = gang(broker, lo=4, hi=4)
    (unused,) = set(NODES) - set(nodes_of(broker.target(job.id).gpus))
    with pytest.raises(InvalidRequest, match=f"node '{unused}' has none of job"):
        broker.ack(job.id, 1, node=unused)


def test_node_acks_of_an_ended_job_change_nothing(pool):
    broker = pool
    job = gang(broker)
    broker.ack(job.id, 1, node="node-a")
    broker.fail(job.id, "node-b's pod was evicted")
    assert broker.ack(job.id, 1, node="node-b") is False
    assert broker.job(job.id).status is JobStatus.FAILED and broker.job(job.id).in_use_gpus == ()


def test_concurrent_node_acks_complete_the_generation_exactly_once(pool):
    broker = pool
    job = gang(broker)
    barrier = threading.Barrier(len(NODES))
    errors: list[BaseException] = []

    def ack(node: str) -> None:
        try:
            barrier.wait()
            broker.ack(job.id, 1, node=node)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ack, args=(n,)) for n in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert broker.job(job.id).acked_generation == 1
    assert len([e for e in broker.events(job_id=job.id) if e.kind == EventKind.ACK.value]) == 1


def test_the_http_api_takes_the_node_of_an_ack(pool):
    broker = pool
    job = gang(broker)
    client = TestClient(create_app(broker))
    auth = {"Authorization": f"Bearer {job.token}"}
    for node in NODES[:2]:
        answer = client.post(f"/api/v1/jobs/{job.id}/ack", json={"generation": 1, "node": node}, headers=auth)
        assert answer.status_code == 200 and answer.json() == {"accepted": True}
    assert broker.job(job.id).acked_generation == 0
    bad = client.post(f"/api/v1/jobs/{job.id}/ack", json={"generation": 1, "node": "elsewhere"}, headers=auth)
    assert bad.status_code == 422
    client.post(f"/api/v1/jobs/{job.id}/ack", json={"generation": 1, "node": NODES[2]}, headers=auth)
    assert broker.job(job.id).acked_generation == 1


def test_after_a_cancel_each_node_s_stop_report_frees_that_node_s_gpus(pool):
    """A cancelled gang's GPUs are held until its trainers have stopped; each pod's agent reports
    its own node, and only that node's GPUs go to other jobs (not the nodes still stopping)."""
    broker = pool
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    broker.cancel(job.id)
    waiting = broker.submit(JobSpec("waiting", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    broker.rebalance()
    assert broker.job(waiting.id).target_gpus == ()
    broker.fail(job.id, "the trainer stopped (cancelled)", node="node-b")
    assert nodes_of(broker.job(job.id).in_use_gpus) == ["node-a", "node-c"]
    broker.rebalance()
    assert nodes_of(broker.job(waiting.id).target_gpus) == ["node-b"]
    broker.fail(job.id, "the trainer stopped (cancelled)", node="node-a")
    broker.fail(job.id, "the trainer stopped (cancelled)", node="node-c")
    ended = broker.job(job.id)
    assert ended.status is JobStatus.CANCELLED and ended.in_use_gpus == () and ended.target_gpus == ()
    releases = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.RELEASE.value]
    assert [sorted({g.split(":")[0] for g in e.data["gpus"]}) for e in releases] == [["node-b"], ["node-a"],
                                                                                        ["node-c"]]
    assert all("node" in e.message for e in releases)


def test_one_node_s_failure_fails_the_gang_and_holds_the_other_nodes_until_they_stop(pool, clock):
    """One pod's trainer dies: its agent fails the job for its node. The other nodes' trainers run
    until their agents see the end, so their GPUs stay held until they report, or until the
    lease passes without a heartbeat."""
    broker = pool
    broker.configure_pool(lease_s=30)
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    broker.fail(job.id, "trainer on node node-c exited with code 1", 1, node="node-c")
    failed = broker.job(job.id)
    assert failed.status is JobStatus.FAILED and failed.exit_code == 1
    assert nodes_of(failed.in_use_gpus) == ["node-a", "node-b"]
    broker.fail(job.id, "the trainer stopped (failed)", node="node-a")
    assert nodes_of(broker.job(job.id).in_use_gpus) == ["node-b"]
    assert broker.job(job.id).reason == "trainer on node node-c exited with code 1"  # the first report stays
    clock.advance(31)  # node-b's agent is silent: its launcher has fenced the trainer by now
    broker.rebalance()
    assert broker.job(job.id).in_use_gpus == ()


def test_the_http_api_takes_the_node_of_a_failure(pool):
    broker = pool
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    client = TestClient(create_app(broker))
    auth = {"Authorization": f"Bearer {job.token}"}
    answer = client.post(f"/api/v1/jobs/{job.id}/fail", json={"reason": "oom", "exit_code": 1, "node": "node-a"},
                         headers=auth)
    assert answer.status_code == 200 and answer.json()["status"] == "failed"
    assert nodes_of(broker.job(job.id).in_use_gpus) == ["node-b", "node-c"]
    bad = client.post(f"/api/v1/jobs/{job.id}/fail", json={"reason": "x", "node": ""}, headers=auth)
    assert bad.status_code == 422


def test_a_gang_s_end_reported_by_one_node_holds_the_others_until_they_report(pool):
    """The pod whose trainer printed the final metrics reports the end for its node; the other
    pods' trainers end about then, and each pod's agent reports its own node once it sees the end."""
    broker = pool
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    done = broker.finish(job.id, 0, {"accuracy": 0.9}, node="node-a")
    assert done.status is JobStatus.SUCCEEDED and nodes_of(done.in_use_gpus) == ["node-b", "node-c"]
    for node in NODES[1:]:
        broker.fail(job.id, "the trainer finished", node=node)
    assert broker.job(job.id).in_use_gpus == () and broker.job(job.id).status is JobStatus.SUCCEEDED


def test_a_node_s_clean_exit_without_metrics_keeps_the_gang_running_and_its_allocation_fixed(pool):
    """A node whose trainer exited with 0 without the final metrics line (not the global rank 0):
    the job runs on with every GPU (rank 0 may still evaluate or write its last checkpoint), no
    rebalance resizes it, and the metrics, whenever they come, end it with every exited node
    freed at once."""
    broker = pool
    job = gang(broker, lo=4, hi=6)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    running = broker.finish(job.id, 0, None, node="node-b")
    assert running.status is JobStatus.RUNNING and len(running.in_use_gpus) == 6
    assert broker.finish(job.id, 0, None, node="node-b").status is JobStatus.RUNNING  # a retry: the same
    (finishing,) = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.FINISHING.value]
    assert "node-b" in finishing.message and "node-a, node-c" in finishing.message
    other = broker.submit(JobSpec("other", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    broker.rebalance()  # the policy would shrink the gang to 4 GPUs for the newcomer: not published
    assert broker.target(job.id).generation == 1 and broker.job(other.id).status is JobStatus.QUEUED
    broker.finish(job.id, 0, None, node="node-c")
    assert broker.job(job.id).status is JobStatus.RUNNING
    broker.register_node("node-d", 2)
    broker.finish(job.id, 0, None, node="node-d")  # not one of the job's nodes: nothing recorded
    assert [e.message for e in broker.events(job_id=job.id) if "node-d" in e.message] == []
    done = broker.finish(job.id, 0, {"accuracy": 0.9}, node="node-a")
    assert done.status is JobStatus.SUCCEEDED and done.metrics == {"accuracy": 0.9}
    assert done.in_use_gpus == () and done.target_gpus == ()  # every node's trainer had exited
    assert broker.job(other.id).status is JobStatus.RUNNING  # the freed GPUs went to the newcomer


def test_a_gang_whose_trainers_all_exit_without_metrics_succeeds_with_the_last_node(pool):
    broker = pool
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    for node in NODES[:-1]:
        assert broker.finish(job.id, 0, None, node=node).status is JobStatus.RUNNING
    done = broker.finish(job.id, 0, None, node=NODES[-1])
    assert done.status is JobStatus.SUCCEEDED and done.metrics is None and done.in_use_gpus == ()


def test_a_failing_node_fails_a_finishing_gang_and_frees_the_nodes_that_had_exited(pool):
    broker = pool
    job = gang(broker)
    for node in NODES:
        broker.ack(job.id, 1, node=node)
    broker.finish(job.id, 0, None, node="node-a")
    failed = broker.fail(job.id, "trainer on node node-b exited with code 1", 1, node="node-b")
    assert failed.status is JobStatus.FAILED
    assert nodes_of(failed.in_use_gpus) == ["node-c"]  # still stopping: held until its agent reports


def test_an_end_report_naming_a_node_outside_the_pool_is_rejected_and_changes_nothing(pool):
    broker = pool
    job = gang(broker)
    with pytest.raises(InvalidRequest, match="'elsewhere' is not a node of GPU pool"):
        broker.fail(job.id, "oops", node="elsewhere")
    assert broker.job(job.id).status is JobStatus.RUNNING


def test_a_node_s_clean_exit_before_the_first_ack_waits_for_the_others(pool):
    """A node's trainer exited with 0 before every node had acked the first generation (nothing
    is in use yet): the job runs on, waiting for the other nodes of its target, instead of
    succeeding without metrics and stopping the trainer that would print them."""
    broker = pool
    job = gang(broker)
    broker.ack(job.id, 1, node="node-b")
    running = broker.finish(job.id, 0, None, node="node-b")
    assert running.status is JobStatus.RUNNING and len(running.target_gpus) == 6
    (finishing,) = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.FINISHING.value]
    assert "node-a, node-c" in finishing.message
    done = broker.finish(job.id, 0, {"accuracy": 0.9}, node="node-a")
    assert done.status is JobStatus.SUCCEEDED and done.metrics == {"accuracy": 0.9}
    assert nodes_of((*done.target_gpus, *done.in_use_gpus)) == ["node-c"]  # held until its agent reports


def test_a_gang_whose_nodes_all_exit_cleanly_before_a_published_growth_succeeds(pool):
    """A growth to a third node was published (not acked) when both nodes' trainers exited with 0
    without metrics: the job succeeds; it does not wait for the node its trainers never ran on."""
    broker = pool
    other = broker.submit(JobSpec("other", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    broker.ack(other.id, 1)
    job = gang(broker, lo=4, hi=6)
    ran = nodes_of(broker.target(job.id).gpus)
    assert len(ran) == 2
    for node in ran:
        broker.ack(job.id, 1, node=node)
    broker.finish(other.id)  # its node's GPUs free: the gang grows onto them
    assert broker.target(job.id).generation == 2 and len(nodes_of(broker.target(job.id).gpus)) == 3
    assert broker.finish(job.id, 0, None, node=ran[0]).status is JobStatus.RUNNING
    done = broker.finish(job.id, 0, None, node=ran[1])
    assert done.status is JobStatus.SUCCEEDED
    # the grown-onto node's pod may be starting a trainer: its GPUs stay held until its agent reports
    assert nodes_of(done.target_gpus) == sorted(set(NODES) - set(ran))


def test_a_node_that_already_runs_a_growths_generation_is_waited_for_and_freed_at_the_end(pool):
    """A growth onto a third node is acked by some nodes, not yet by all (the in-use set is still the
    old one): a trainer already running it there that exits cleanly is recorded, and its node's
    GPUs are freed with the job's end rather than held until its agent reports again."""
    broker = pool
    other = broker.submit(JobSpec("other", "python train.py", 2, 2, total_steps=100, backend="kubernetes"))
    broker.ack(other.id, 1)
    job = gang(broker, lo=4, hi=6)
    ran = nodes_of(broker.target(job.id).gpus)
    for node in ran:
        broker.ack(job.id, 1, node=node)
    broker.finish(other.id)
    (grown,) = set(NODES) - set(ran)
    assert broker.target(job.id).generation == 2
    broker.ack(job.id, 2, node=grown)
    broker.ack(job.id, 2, node=ran[1])
    assert broker.job(job.id).acked_generation == 1  # ran[0] has not acked yet
    running = broker.finish(job.id, 0, None, node=grown)
    assert running.status is JobStatus.RUNNING
    (finishing,) = [e for e in broker.events(job_id=job.id) if e.kind == EventKind.FINISHING.value]
    assert grown in finishing.message
    done = broker.finish(job.id, 0, {"accuracy": 0.9}, node=ran[0])
    assert done.status is JobStatus.SUCCEEDED
    held = nodes_of((*done.target_gpus, *done.in_use_gpus))
    assert grown not in held and ran[1] in held  # ran[1]'s trainer still stopping: held until it reports
