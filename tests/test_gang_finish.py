"""A gang of launchers on this host (virtual nodes) whose trainers end unevenly: the node that is not
global rank 0 exits with 0 while rank 0 still evaluates. No new generation may stop rank 0 then (its
evaluation and final metrics would be lost, and the finished node has no trainer to restart): the
agent reports the finished node as a gang of pods' agent does, the broker keeps the allocation
fixed, and a newcomer waits for the GPUs until the job's end."""

from __future__ import annotations

import sys
import time

from test_gang import GANG_ARGS, STAND_IN_GANG_TRAINER, gang_run, gang_setup, starts

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent
from airflow_elastic_gpu.states import Target

# rank 0 evaluates after the other nodes ended: it prints the final metrics once EVAL_DONE exists
EVALUATING_TRAINER = STAND_IN_GANG_TRAINER.replace(
    '(ckpt / "done").write_text("1")\n',
    '(ckpt / "done").write_text("1")\n'
    'while not Path(os.environ["EVAL_DONE"]).exists():\n'
    '    time.sleep(0.05)\n',
)


def test_a_gang_whose_other_node_finished_is_not_resized_while_rank_0_evaluates(tmp_path, monkeypatch):
    evaluated = tmp_path / "evaluated"
    monkeypatch.setenv("EVAL_DONE", str(evaluated))
    broker, backend = gang_setup(tmp_path, grace_s=5)
    trainer = tmp_path / "gang_trainer.py"
    trainer.write_text(EVALUATING_TRAINER)
    with gang_run(broker, backend, 120) as run:
        gang = run.launch("gang", f"{sys.executable} {trainer} 150 {GANG_ARGS}", 2, 4, 150)
        node_1 = backend.job_dir(gang) / protocol.NODES / "localhost-1" / protocol.STATUS
        run.wait("the node that is not rank 0 exits with 0",
                 lambda: (protocol.read_json(node_1) or {}).get("state") == protocol.EXITED)
        assert broker.job(gang).status is JobStatus.RUNNING and len(broker.job(gang).in_use_gpus) == 4
        # a newcomer the policy would make room for by shrinking the gang to one node
        newcomer = run.launch("newcomer", f"{sys.executable} {trainer} 20 {GANG_ARGS}", 2, 2, 20)
        run.wait("the broker records the finished node",
                 lambda: any(e.kind == "finishing" for e in broker.events(job_id=gang)))
        time.sleep(3.0)  # policy rounds (min_resize_interval_s 2 s) with the newcomer waiting
        assert broker.job(gang).status is JobStatus.RUNNING and len(broker.job(gang).in_use_gpus) == 4
        assert broker.job(newcomer).status is JobStatus.QUEUED
        evaluated.write_text("1")
        run.wait("both end", run.ended)
    done = broker.job(gang)
    assert done.status is JobStatus.SUCCEEDED and done.metrics["accuracy"] == 0.95, done.reason
    assert broker.job(newcomer).status is JobStatus.SUCCEEDED, broker.job(newcomer).reason
    rank_0_runs = starts(backend.job_dir(gang) / protocol.NODES / "localhost-0" / protocol.LOG)
    assert len(rank_0_runs) == 1, rank_0_runs  # never stopped mid-evaluation
    kinds = [e.kind for e in broker.events(job_id=gang)]
    assert "resize" not in kinds[kinds.index("finishing"):], kinds  # one published before it is not applied
    assert run.sampler.violations == []


class FinishBroker:
    """What the agent's finishing gang calls of the broker: the finished nodes' reports."""

    def __init__(self) -> None:
        self.finished: list[str | None] = []

    def finish(self, job_id, exit_code=0, metrics=None, *, node=None):
        self.finished.append(node)


# the broker shrinks the finishing gang to rank 0's node, by a generation published before the
# finished node's report reached it
SHRINK = Target("j", JobStatus.RUNNING, 4, (GpuId("localhost-0", 0), GpuId("localhost-0", 1)), 60.0)


def finishing_gang(tmp_path, rank_0: dict) -> tuple[Agent, FinishBroker, dict]:
    """An agent of a gang on two virtual nodes running generation 3 on four GPUs, whose node
    localhost-1 (not global rank 0) has exited with 0 and whose rank 0 is as ``rank_0`` says."""
    dirs = {n: tmp_path / protocol.NODES / n for n in ("localhost-0", "localhost-1")}
    for d in dirs.values():
        d.mkdir(parents=True)
    broker = FinishBroker()
    agent = Agent(broker, "j", tmp_path, poll_s=0.05)
    agent.gang.publish(3, [("localhost-0", 0), ("localhost-0", 1), ("localhost-1", 0), ("localhost-1", 1)])
    protocol.write_json(dirs["localhost-0"] / protocol.STATUS, {"generation": 3, **rank_0})
    protocol.write_json(dirs["localhost-1"] / protocol.STATUS, {"state": "exited", "exit_code": 0, "generation": 3})
    return agent, broker, dirs


def test_a_finishing_gang_applies_no_newer_generation(tmp_path):
    """The broker published a generation before the finished node's report reached it: the agent
    does not hand it to the launchers (it would stop rank 0 and never run on the finished node)."""
    agent, broker, dirs = finishing_gang(tmp_path, {"state": "running", "pid": 11})
    before = {n: agent.gang.desired(n) for n in dirs}
    assert agent._apply_gang(SHRINK, 3) == 3
    assert {n: agent.gang.desired(n) for n in dirs} == before
    agent._report_clean_nodes()
    agent._report_clean_nodes()
    assert broker.finished == ["localhost-1"]  # reported once
    protocol.write_json(dirs["localhost-0"] / protocol.STATUS, {"state": "exited", "exit_code": 0, "generation": 3})
    broker.finished.clear()
    agent.clean_nodes.clear()
    agent._report_clean_nodes()
    assert broker.finished == []  # every node ended: the job's end is reported whole, with the metrics


def test_a_finishing_gang_s_fenced_trainer_restarts_on_the_generation_it_runs(tmp_path):
    """Rank 0 was fenced (the broker unreachable for a while) while the gang was finishing and a
    newer generation had been published before the finished node's report: once the broker
    answers again, rank 0 may restart on the generation it ran (the broker keeps that
    generation's GPUs until the newer one is acked, which a finishing gang never does)."""
    agent, _, _ = finishing_gang(tmp_path, {"state": "fenced", "fences": 1})
    assert agent._apply_gang(SHRINK, 3) == 3
    assert agent.gang.desired("localhost-0")["resume"] == 1 and agent.gang.desired("localhost-0")["generation"] == 3
    assert "resume" not in agent.gang.desired("localhost-1")  # its trainer exited: nothing to restart
