"""A gang of pods' agents, one per node: each writes its node's part of a generation (with the rank-0
pod's DNS name and the peers' longest delay), acks and reports its own node, suspends and resumes
with the whole gang, and reports its node's end (the gang's life against the CoreV1 API:
``test_kubernetes_gang.py``)."""

from __future__ import annotations

import json
import time

import pytest

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent
from airflow_elastic_gpu.states import Target


class FakeBroker:
    """What a pod's agent calls; heartbeats answer ``answers`` in turn (the last one for ever);
    records acks and reports."""

    def __init__(self, *answers: Target) -> None:
        self.answers = list(answers)
        self.acks: list[tuple[int, str | None]] = []
        self.reports: list[tuple] = []
        self.report_nodes: list[str | None] = []  # the node of each finish/fail report

    def heartbeat(self, job_id):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def progress(self, job_id, step, *, generation=None, time_s=None):
        self.reports.append(("progress", step))

    def ack(self, job_id, generation, *, node=None):
        self.acks.append((generation, node))
        return True

    def finish(self, job_id, exit_code=0, metrics=None, *, node=None):
        self.reports.append(("finish", metrics))
        self.report_nodes.append(node)

    def fail(self, job_id, reason, exit_code=None, metrics=None, *, node=None):
        self.reports.append(("fail", reason))
        self.report_nodes.append(node)


def target(generation, pairs, status=JobStatus.RUNNING):
    return Target("j", status, generation, tuple(sorted(GpuId(n, i) for n, i in pairs)), 60.0)


def node_agent(tmp_path, broker, node):
    return Agent(broker, "j", tmp_path, poll_s=0.01, node=node, gang_domain="elastic-gpu-j.ml.svc",
                 rendezvous_port=29500, end_report_timeout_s=60)


def test_each_pods_agent_writes_its_nodes_part_with_the_rank0_pods_dns_name(tmp_path):
    gen = target(2, [("gpu-node-1", 0), ("gpu-node-1", 1), ("ip-10-0-3-7.ec2.internal", 3)])
    agent = node_agent(tmp_path, FakeBroker(gen), "ip-10-0-3-7.ec2.internal")
    assert agent._apply(gen, 1) == 2
    desired = protocol.read_json(tmp_path / protocol.DESIRED)
    assert desired == {"generation": 2, "gpus": [3], "nnodes": 2, "node_rank": 1, "stop": False,
                       "master_addr": "gpu-node-1.elastic-gpu-j.ml.svc", "master_port": 29500}
    dropped = target(3, [("gpu-node-1", 0), ("gpu-node-1", 1)])
    agent._apply(dropped, 2)  # a generation without this node: suspended, then acked like any other
    assert protocol.read_json(tmp_path / protocol.DESIRED) == {"generation": 3, "gpus": [], "stop": False}


def test_a_pods_agent_gives_its_launcher_the_peers_longest_delay_in_seeing_a_generation(tmp_path):
    """Each pod's agent polls the broker: another pod's may see the next generation up to two
    polls and three request timeouts later (heartbeat, progress, ack), which the launcher gives a
    trainer that failed as its peer stopped first (see launcher.py)."""
    gen = target(1, [("gpu-node-0", 0), ("gpu-node-1", 0)])
    broker = FakeBroker(gen)
    broker.timeout_s = 10.0  # the HTTP transport's per-request timeout
    agent = node_agent(tmp_path, broker, "gpu-node-1")
    agent._renew(time.time(), gen)
    assert protocol.read_json(tmp_path / protocol.LEASE)["peer_wait_s"] == pytest.approx(2 * 0.01 + 3 * 10.0)


@pytest.mark.parametrize("pod_generation", [None, 2])
def test_a_pods_agent_suspends_its_node_with_the_whole_gang_and_resumes_it(tmp_path, pod_generation):
    """The gang suspended (a generation with no GPUs): each pod's agent, of an in-place pod or of a
    pod made for one generation (re-creation), hands its launcher no GPUs (the trainer checkpoints
    and stops; the agent then acks its node); the resume gives an in-place pod its part again."""
    running = target(2, [("gpu-node-0", 0), ("gpu-node-1", 0)])
    agent = node_agent(tmp_path, FakeBroker(running), "gpu-node-1")
    agent.pod_generation = pod_generation
    assert agent._apply(running, 1) == 2
    suspended = target(3, [], status=JobStatus.SUSPENDED)
    assert agent._apply(suspended, 2) == 3
    assert protocol.read_json(tmp_path / protocol.DESIRED) == {"generation": 3, "gpus": [], "stop": False}
    resumed = target(4, [("gpu-node-0", 1), ("gpu-node-1", 1)])
    assert agent._apply(resumed, 3) == 4
    desired = protocol.read_json(tmp_path / protocol.DESIRED)
    if pod_generation is None:
        assert (desired["generation"], desired["gpus"], desired["nnodes"]) == (4, [1], 2)
    else:  # this pod runs generation 2 only: the new generation's pod replaces it
        assert desired["generation"] == 3 and desired["gpus"] == []


def test_a_pods_agent_acks_its_node_only(tmp_path):
    gen = target(1, [("gpu-node-0", 0), ("gpu-node-1", 0)])
    broker = FakeBroker(gen)
    agent = node_agent(tmp_path, broker, "gpu-node-1")
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})
    (tmp_path / protocol.LOG).write_text(json.dumps({"final": True, "step": 10, "loss": 0.1}) + "\n")
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    assert agent._ack(1) and broker.acks == [(1, "gpu-node-1")]
    assert agent.run() == 0  # this node's trainer printed the final metrics: it reports the end
    assert ("finish", {"final": True, "step": 10, "loss": 0.1}) in broker.reports
    assert broker.report_nodes == ["gpu-node-1"]  # its node's GPUs: the others' when their agents report


def test_a_pod_whose_trainer_ends_without_metrics_reports_its_node_and_waits_for_the_end(tmp_path):
    """Not the global rank 0: the agent reports its node's clean exit without metrics (the broker
    records it, the job runs on) and heartbeats until the job has ended, however long rank 0's
    trainer still runs; it reports nothing more (the broker freed its node at the end)."""
    running = target(1, [("gpu-node-0", 0), ("gpu-node-1", 0)])
    ended = target(1, [], status=JobStatus.SUCCEEDED)  # the other pod's agent reported it, with metrics
    broker = FakeBroker(running, *[running] * 50, ended)
    agent = node_agent(tmp_path, broker, "gpu-node-0")
    agent.end_report_timeout_s = 0.0  # a deadline on waiting would give up long before the end
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    (tmp_path / protocol.LOG).write_text(json.dumps({"step": 10}) + "\n")  # not the global rank 0's metrics
    assert agent.run() == 0
    assert broker.answers == [ended]  # it waited, heartbeating, until the job had ended
    assert [r for r in broker.reports if r[0] in ("finish", "fail")] == [("finish", None)]
    assert broker.report_nodes == ["gpu-node-0"]


def test_a_pod_waiting_for_the_end_gives_up_when_the_broker_stays_unreachable(tmp_path):
    broker = FakeBroker(target(1, [("gpu-node-0", 0), ("gpu-node-1", 0)]))
    agent = node_agent(tmp_path, broker, "gpu-node-0")
    agent.end_report_timeout_s = 0.2
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    (tmp_path / protocol.LOG).write_text(json.dumps({"step": 10}) + "\n")
    beats = []

    def unreachable(job_id):
        beats.append(job_id)
        raise OSError("connection refused")

    broker.heartbeat = unreachable
    assert agent._report_exit(0) == 1  # the job's lease ends it
    assert broker.reports[-1] == ("finish", None) and len(beats) > 1


def test_a_cancelled_gang_s_pod_agent_reports_its_own_node_stopped(tmp_path):
    """After a cancel each pod's agent stops its node's trainer and reports that node, so the
    broker frees that node's GPUs now (not after the lease) and the others' when they report."""
    cancelled = target(1, [], status=JobStatus.CANCELLED)
    broker = FakeBroker(cancelled)
    agent = node_agent(tmp_path, broker, "gpu-node-1")
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    assert agent.run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED)["stop"] is True
    (report,) = [r for r in broker.reports if r[0] == "fail"]
    assert broker.report_nodes == ["gpu-node-1"] and "stopped" in report[1]


def test_a_gang_pod_deleted_after_its_job_ended_reports_its_node_stopped(tmp_path):
    """The trigger deletes a failed gang's pods: each pod's agent (SIGTERM) sees the job ended, stops
    its node's trainer and reports the node, so those GPUs need not wait for the lease."""
    broker = FakeBroker(target(1, [], status=JobStatus.FAILED))
    agent = node_agent(tmp_path, broker, "gpu-node-2")
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.STOPPED})
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    agent.terminating.set()
    assert agent.run() == 0
    assert [r[0] for r in broker.reports] == ["fail"] and broker.report_nodes == ["gpu-node-2"]


def test_a_pod_of_a_node_the_gang_gave_up_stops_quietly_when_deleted(tmp_path):
    """A gang shrinks off this pod's node: the pod is deleted once every node has acked, and its
    launcher stops first (the agent is a native sidecar). That is the resize, not a failure: the
    agent reports nothing (before, it failed the running job: "stopped from outside")."""
    shrunk = target(2, [("gpu-node-0", 0)])
    broker = FakeBroker(shrunk)
    agent = node_agent(tmp_path, broker, "gpu-node-1")
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 2, "state": protocol.STOPPED})
    assert agent.run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED)["gpus"] == []
    assert not [r for r in broker.reports if r[0] in ("finish", "fail")]
