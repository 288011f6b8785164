"""A pool's nodes over their life: drained, made schedulable again, removed (retired, or moved to
another pool), from the broker and from the CLI; and one name in one pool only, also when two
first registrations race (PostgreSQL)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import RESIZE_AT_ONCE
from kubernetes.client import models as k8s
from sqlalchemy import text

from airflow_elastic_gpu.backends.kubernetes import register_nodes_from_cluster
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec, NotFound
from airflow_elastic_gpu.states import JobStatus


def spec(name, lo=1, hi=2):
    return JobSpec(name, "python train.py", lo, hi, total_steps=1000)


def test_a_node_holding_a_jobs_gpus_is_removed_only_once_drained_and_free(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    job = broker.submit(spec("train", 2, 2))
    broker.ack(job.id, 1)
    (on,) = {g.node for g in broker.job(job.id).in_use_gpus}
    (other,) = {"n0", "n1"} - {on}
    with pytest.raises(InvalidRequest, match=rf"node '{on}' of pool 'default' has GPUs of job\(s\) {job.id}: drain it"):
        broker.remove_node(on)
    broker.set_node_schedulable(on, False)
    target = broker.target(job.id)
    assert {g.node for g in target.gpus} == {other}  # the drain moved the job off the node ...
    with pytest.raises(InvalidRequest, match="drain it first"):
        broker.remove_node(on)  # ... but its trainer runs there until it acks
    broker.ack(job.id, target.generation)
    broker.remove_node(on)
    assert [n.name for n in broker.nodes()] == [other]
    assert broker.job(job.id).status is JobStatus.RUNNING
    assert any(e.message == f"removed node {on} with 2 GPU(s)" for e in broker.events())
    broker.register_node(on, 2, pool="other")  # moved: its name is free for another pool now
    assert [n.pool for n in broker.nodes("other")] == ["other"]
    with pytest.raises(NotFound, match=f"unknown node '{on}' in pool 'default'"):
        broker.remove_node(on)


@pytest.mark.postgres
@pytest.mark.parametrize("broker_url", ["postgresql"], indirect=True)
def test_two_first_registrations_of_one_name_in_two_pools_cannot_both_pass(broker):
    """The registration in pool ``b`` has checked that no other pool has the name; a registration in
    pool ``a`` commits before it inserts (held here by the lock both take). It must see it."""
    broker.register_node("seed", 1, pool="a")  # pool a exists
    holder = broker.engine.connect()
    holder.begin()
    holder.execute(text("SELECT pg_advisory_xact_lock(724102)"))  # the lock of first registrations
    errors: list[BaseException] = []

    def register() -> None:
        try:
            GpuBroker(broker.url, clock=broker.clock).register_node("gpu-node-7", 1, pool="b")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    racer = threading.Thread(target=register)
    racer.start()
    with broker.engine.connect() as watch:  # wait until it waits for the lock, past its first look
        for _ in range(200):
            if watch.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")).scalar():
                break
            time.sleep(0.05)
        else:
            pytest.fail("the registration never waited for the lock")
    # the other registration commits first (as register_node would, in the same transaction)
    holder.execute(text("INSERT INTO node (pool, name, schedulable) VALUES ('a', 'gpu-node-7', true)"))
    holder.commit()
    holder.close()
    racer.join(30)
    assert len(errors) == 1 and isinstance(errors[0], InvalidRequest)
    assert "node 'gpu-node-7' is already in GPU pool 'a'" in str(errors[0])
    assert [n.pool for n in broker.nodes() if n.name == "gpu-node-7"] == ["a"]


def test_the_cli_drains_uncordons_and_removes_a_node(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'b.db'}")
    assert main(["nodes", "add", "gpu-node-1", "--gpus", "2"]) == 0
    assert main(["nodes", "drain", "gpu-node-1"]) == 0
    assert "gpu-node-1" in capsys.readouterr().out
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    assert [n.schedulable for n in broker.nodes()] == [False]
    assert main(["nodes", "uncordon", "gpu-node-1"]) == 0
    assert [n.schedulable for n in broker.nodes()] == [True]
    capsys.readouterr()
    assert main(["nodes", "remove"]) != 0
    assert "`nodes remove` needs the node's NAME" in capsys.readouterr().err
    assert main(["nodes", "remove", "gpu-node-1"]) == 0
    assert "removed node 'gpu-node-1' from pool 'default'" in capsys.readouterr().out
    assert broker.nodes() == []
    assert main(["nodes", "remove", "gpu-node-1"]) != 0
    assert "unknown node 'gpu-node-1' (`nodes list`" in capsys.readouterr().err


def test_the_cli_finds_a_nodes_pool_by_its_name(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'b.db'}")
    assert main(["nodes", "add", "gpu-node-2", "--gpus", "2", "--pool", "a100"]) == 0
    assert main(["nodes", "drain", "gpu-node-2"]) == 0  # no --pool: the one pool that has it
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    assert [(n.pool, n.schedulable) for n in broker.nodes()] == [("a100", False)]
    capsys.readouterr()
    assert main(["nodes", "remove", "gpu-node-9"]) != 0
    assert "unknown node 'gpu-node-9' (`nodes list` shows the nodes of every pool)" in capsys.readouterr().err
    assert main(["nodes", "remove", "gpu-node-2"]) == 0 and broker.nodes() == []


def test_a_gpu_out_of_service_goes_to_no_job_and_its_job_moves_off_it(broker):
    """A failing GPU (Xid or ECC errors) of a node that is otherwise fine: the job on it moves to a
    healthy GPU, no job gets it, and once back in service it is handed out again."""
    broker.register_node("n0", 3)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    job = broker.submit(spec("train", 2, 2))
    assert [g.index for g in job.target_gpus] == [0, 1]
    broker.ack(job.id, 1)
    broker.set_gpus_healthy("n0", [1], False)
    moved = broker.job(job.id)
    assert [g.index for g in moved.target_gpus] == [0, 2] and moved.target_generation == 2
    assert [g.index for g in moved.in_use_gpus] == [0, 1]  # its trainer runs there until it acks
    broker.ack(job.id, 2)
    waiting = broker.submit(spec("waits", 1, 1))
    assert broker.job(waiting.id).target_gpus == ()  # GPU 1 is free, and out of service
    [node] = broker.nodes()
    assert [(g.gpu.index, g.healthy, g.in_use_by) for g in node.gpus] == [
        (0, True, job.id), (1, False, None), (2, True, job.id)]
    assert "GPU(s) n0:1 out of service (unhealthy)" in [e.message for e in broker.events()]
    broker.set_gpus_healthy("n0", [1], True)
    assert [g.index for g in broker.job(waiting.id).target_gpus] == [1]
    with pytest.raises(NotFound, match=r"node 'n0' has no GPU 7 \(its GPUs: \[0, 1, 2\]\)"):
        broker.set_gpus_healthy("n0", [7], False)


def test_a_job_whose_gpu_fails_with_no_room_elsewhere_keeps_running_until_room_appears(broker):
    broker.register_node("n0", 2)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    job = broker.submit(spec("train", 2, 2))
    broker.ack(job.id, 1)
    broker.set_gpus_healthy("n0", [0], False)
    kept = broker.job(job.id)
    assert kept.status is JobStatus.RUNNING and kept.target_generation == 1  # not silently stopped
    broker.register_node("n1", 2)  # room appears
    moved = broker.job(job.id)
    assert moved.target_generation == 2 and {g.node for g in moved.target_gpus} == {"n1"}


def test_the_cli_takes_one_gpu_out_of_service_and_back(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    assert main(["nodes", "add", "gpu-node-1", "--gpus", "4"]) == 0
    capsys.readouterr()
    assert main(["nodes", "drain", "gpu-node-1", "--gpu", "1", "--gpu", "3"]) == 0
    assert "1, 3" in capsys.readouterr().out  # the list's "out of service" column
    [node] = GpuBroker(url).nodes()
    assert node.schedulable and [g.healthy for g in node.gpus] == [True, False, True, False]
    assert main(["nodes", "uncordon", "gpu-node-1", "--gpu", "3"]) == 0
    assert [g.healthy for g in GpuBroker(url).nodes()[0].gpus] == [True, False, True, True]
    capsys.readouterr()
    assert main(["nodes", "add", "gpu-node-2", "--gpus", "1", "--gpu", "0"]) == 2
    assert "--gpu goes with `nodes drain` or `nodes uncordon`" in capsys.readouterr().err
    assert main(["nodes", "drain", "gpu-node-1", "--gpu", "9"]) == 2
    assert "node 'gpu-node-1' has no GPU 9" in " ".join(capsys.readouterr().err.split())


def node(name, allocatable, cordoned=False):
    """A Kubernetes node with 4 GPUs (GPU feature discovery's count label), ``allocatable`` of them
    offered by its device plugin."""
    return k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"nvidia.com/gpu.count": "4"}),
                      spec=k8s.V1NodeSpec(unschedulable=cordoned or None),
                      status=k8s.V1NodeStatus(capacity={"nvidia.com/gpu": "4"},
                                              allocatable={"nvidia.com/gpu": str(allocatable)}))


class Cluster:
    """The one call of the Kubernetes API kube-sync makes, on a list of nodes."""

    def __init__(self, nodes=()) -> None:
        self.nodes = list(nodes)

    def list_node(self, label_selector=None):
        return type("Listing", (), {"items": self.nodes})()


def test_kube_sync_carries_a_clusters_cordons_and_unhealthy_gpus_over_one_way(tmp_path):
    """The device plugin offers fewer GPUs than the node has (some unhealthy): a pod asking for them
    would stay Pending, so that many GPUs go out of service, free ones first; a cordoned node is
    drained. A second sync changes nothing more, and neither is undone by a sync."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    cluster = Cluster()
    cluster.nodes = [node("g0", 4), node("g1", 4)]
    register_nodes_from_cluster(broker, cluster, pool="gpus")
    job = broker.submit(JobSpec("train", "python train.py", 3, 3, total_steps=1000, pool="gpus"))
    (on,) = {g.node for g in job.target_gpus}
    held = sorted(g.index for g in job.target_gpus)
    assert held == [0, 1, 2]
    cluster.nodes = [node(on, 2), node({"g0", "g1"}.difference([on]).pop(), 4, cordoned=True)]
    for _ in range(2):
        register_nodes_from_cluster(broker, cluster, pool="gpus")
        views = {n.name: n for n in broker.nodes("gpus")}
        # two of four offered: the free GPU 3 first, then the highest held one
        assert [g.gpu.index for g in views[on].gpus if not g.healthy] == [2, 3]
        assert views[on].schedulable and not views[({"g0", "g1"} - {on}).pop()].schedulable
    cluster.nodes = [node("g0", 4), node("g1", 4)]  # healthy again: the broker waits for an uncordon
    register_nodes_from_cluster(broker, cluster, pool="gpus")
    assert sum(not g.healthy for n in broker.nodes("gpus") for g in n.gpus) == 2
    # a device plugin restarting offers none for a moment, a node rebooting is not Ready: unknown, not unhealthy
    restarting, rebooting = node("g0", 0), node("g1", 1)
    rebooting.status.conditions = [k8s.V1NodeCondition(type="Ready", status="Unknown")]
    cluster.nodes = [restarting, rebooting]
    register_nodes_from_cluster(broker, cluster, pool="gpus")
    assert sum(not g.healthy for n in broker.nodes("gpus") for g in n.gpus) == 2


def test_adding_a_node_again_keeps_its_gpu_type_and_says_it_keeps_its_gpus(tmp_path, monkeypatch, capsys):
    """``nodes add`` on a registered T4 node, without --gpu-type, made its GPUs "virtual" without a
    word (the type-aware policy then placed jobs as on another kind of GPU)."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    assert main(["nodes", "add", "gpu-box", "--gpus", "4", "--gpu-type", "Tesla T4"]) == 0
    capsys.readouterr()
    assert main(["nodes", "add", "gpu-box", "--gpus", "2"]) == 0
    assert "node 'gpu-box' keeps its 4 GPUs" in " ".join(capsys.readouterr().err.split())
    assert main(["nodes", "add", "gpu-box", "--gpus", "6"]) == 0  # two more, of the node's type
    assert [g.gpu_type for g in GpuBroker(url).nodes()[0].gpus] == ["Tesla T4"] * 6
    assert main(["nodes", "add", "gpu-box", "--gpus", "6", "--gpu-type", "NVIDIA L4"]) == 0  # named: changed
    assert {g.gpu_type for g in GpuBroker(url).nodes()[0].gpus} == {"NVIDIA L4"}
    assert main(["nodes", "add", "new-box", "--gpus", "1"]) == 0
    assert [g.gpu_type for n in GpuBroker(url).nodes() if n.name == "new-box" for g in n.gpus] == ["virtual"]


def test_kube_sync_registers_a_new_node_as_it_is_never_offering_what_it_takes_back(tmp_path):
    """A new node with unhealthy GPUs, or cordoned: registered healthy and schedulable first, its GPUs
    went to a waiting job in the registration's rebalance, then some were taken back (a start, then a
    resize: restarts of a training for nothing)."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    register_nodes_from_cluster(broker, Cluster([node("g0", 4)]), pool="gpus")
    broker.submit(JobSpec("big", "python train.py", 4, 4, total_steps=1000, pool="gpus"))
    waiting = broker.submit(JobSpec("waits", "python train.py", 3, 3, total_steps=1000, pool="gpus"))
    register_nodes_from_cluster(broker, Cluster([node("g0", 4), node("g1", 2), node("g2", 4, cordoned=True)]),
                                pool="gpus")
    assert broker.job(waiting.id).target_gpus == ()  # two GPUs of g1 offered, none of g2: no room for 3
    assert [e.kind for e in broker.events(job_id=waiting.id)] == ["submit"]
    views = {n.name: n for n in broker.nodes("gpus")}
    assert [g.gpu.index for g in views["g1"].gpus if not g.healthy] == [2, 3] and not views["g2"].schedulable


def test_kube_sync_drains_a_node_that_left_the_cluster_and_retires_gpus_above_a_lower_count(tmp_path):
    """An autoscaler removed g1 (it is no longer listed): it is drained, so no job is placed there
    for a pod that would stay Pending. g0 now has 2 GPUs (its count label says so): GPUs 2 and 3
    go out of service (trainers would get device indices that do not exist). Both stayed as they
    were."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    cluster = Cluster([node("g0", 4), node("g1", 4)])
    register_nodes_from_cluster(broker, cluster, pool="gpus")
    smaller = node("g0", 2)
    smaller.metadata.labels["nvidia.com/gpu.count"] = "2"
    smaller.status.capacity["nvidia.com/gpu"] = "2"
    cluster.nodes = [smaller]
    assert register_nodes_from_cluster(broker, cluster, pool="gpus") == ["g0"]
    views = {n.name: n for n in broker.nodes("gpus")}
    assert not views["g1"].schedulable and views["g0"].schedulable
    assert [g.gpu.index for g in views["g0"].gpus if g.healthy] == [0, 1]
    job = broker.submit(JobSpec("train", "python train.py", 1, 2, total_steps=100, pool="gpus"))
    assert {(g.node, g.index) for g in job.target_gpus} == {("g0", 0), ("g0", 1)}


def test_kube_sync_still_counts_unhealthy_gpus_once_a_nodes_count_went_down(tmp_path):
    """g0 goes from 8 GPUs to 4, of which its device plugin offers 3: one of GPUs 0-3 goes out of
    service. The retired GPUs 4-7 counted as unhealthy ones of the 4, and none did."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    eight = node("g0", 8)
    eight.metadata.labels["nvidia.com/gpu.count"] = "8"
    eight.status.capacity["nvidia.com/gpu"] = "8"
    register_nodes_from_cluster(broker, Cluster([eight]), pool="gpus")
    four = node("g0", 3)
    for _ in range(2):
        register_nodes_from_cluster(broker, Cluster([four]), pool="gpus")
        (view,) = broker.nodes("gpus")
        assert [g.gpu.index for g in view.gpus if g.healthy] == [0, 1, 2]
