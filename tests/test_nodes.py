"""A pool's nodes over their life: drained, made schedulable again, removed (retired, or moved to
another pool), from the broker and from the CLI; and one name in one pool only, also when two
first registrations race (PostgreSQL)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec, NotFound
from airflow_elastic_gpu.states import JobStatus


def spec(name, lo=1, hi=2):
    return JobSpec(name, "python train.py", lo, hi, total_steps=1000)


def test_a_node_holding_a_jobs_gpus_is_removed_only_once_drained_and_free(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    broker.configure_pool(policy_params={"hysteresis": 0.0, "min_resize_interval_s": 0.0})
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
