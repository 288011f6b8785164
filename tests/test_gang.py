"""Jobs on several nodes (a gang of launchers, one per virtual node, resized together), and a real
trainer suspended and resumed.

The default suite runs a stand-in trainer (a step loop whose speed grows with the gang's GPU
count; rank 0 prints the steps and checkpoints): one job on 2 virtual nodes x 2 GPUs shrinks from
4 GPUs on 2 nodes to 2 GPUs on 1 node to admit a second job, grows back to 4 on 2 nodes when that
ends, and resumes from its checkpoint each time; a sampler checks that no GPU is in two jobs, in
the broker and in the trainers' ``CUDA_VISIBLE_DEVICES``. ``make test-all`` also runs a real PyTorch
DDP job under ``torchrun --nnodes`` across the two nodes, resized 4 -> 2 -> 4 GPUs.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import TRAIN_SCRIPT

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.gang import Gang

GANG_ARGS = "--nnodes {nnodes} --node-rank {node_rank} --master {master_addr}:{master_port}"

# rank 0 runs the steps (speed: linear in the gang's GPUs), checkpoints on SIGTERM and writes
# "done" at the end; the other ranks wait for SIGTERM or "done", as torchrun's workers would
STAND_IN_GANG_TRAINER = """
import argparse, json, os, signal, sys, time
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("total", type=int)
p.add_argument("--nnodes", type=int)
p.add_argument("--node-rank", type=int)
p.add_argument("--master")
p.add_argument("--until", default=None, help="rank 0 ends (exit 0) once this file exists")
a = p.parse_args()
ckpt = Path(os.environ["ELASTIC_CHECKPOINT_DIR"])
ckpt.mkdir(parents=True, exist_ok=True)
gpus = int(os.environ["ELASTIC_GPU_COUNT"]) * a.nnodes
step = int((ckpt / "step").read_text()) if (ckpt / "step").exists() else 0

def stop(*_):
    if a.node_rank == 0:
        (ckpt / "step").write_text(str(step))
    sys.exit(143)

signal.signal(signal.SIGTERM, stop)
if a.node_rank != 0:
    while not (ckpt / "done").exists():
        time.sleep(0.05)
    sys.exit(0)
print(json.dumps({"event": "start", "step": step, "world_size": gpus, "nnodes": a.nnodes,
                  "master": a.master, "resumed": step > 0}), flush=True)
while step < a.total and not (a.until and Path(a.until).exists()):
    time.sleep(0.08 / gpus)
    step += 1
    print(json.dumps({"step": step}), flush=True)
(ckpt / "done").write_text("1")
print(json.dumps({"final": True, "step": step, "accuracy": 0.95}), flush=True)
"""


def live_devices(job_dir: Path) -> list[set[int]]:
    """The GPU indices each live trainer of a job (one per node of a gang) was started with."""
    dirs = [d for d in sorted((job_dir / protocol.NODES).glob("*"))] or [job_dir]
    out = []
    for d in dirs:
        status = protocol.read_json(d / protocol.STATUS) or {}
        pid = status.get("pid")
        if not pid or status.get("state") not in (protocol.RUNNING, protocol.STOPPING):
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for item in env:
            if item.startswith(b"CUDA_VISIBLE_DEVICES="):
                out.append({int(x) for x in item.split(b"=", 1)[1].decode().split(",") if x})
    return out


class Sampler(threading.Thread):
    """Checks every 0.2 s that no GPU is in two jobs (broker in-use sets, trainers' devices)."""

    def __init__(self, broker: GpuBroker, backend: LocalBackend, job_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.broker, self.backend, self.job_ids = broker, backend, job_ids
        self.samples, self.violations, self.done = 0, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            seen: list[int] = []
            for j in list(self.job_ids):
                for devices in live_devices(self.backend.job_dir(j)):
                    seen += sorted(devices)
            if len(seen) != len(set(seen)):
                self.violations.append(f"trainers share GPUs: {seen}")
            in_use = [g for v in self.broker.jobs() for g in v.in_use_gpus]
            if len(in_use) != len(set(in_use)):
                self.violations.append(f"broker in-use sets overlap: {in_use}")
            self.samples += 1
            time.sleep(0.2)


def gang_setup(tmp_path: Path, grace_s: float) -> tuple[GpuBroker, LocalBackend]:
    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}")
    backend = LocalBackend(tmp_path / "jobs", broker, virtual_gpus=2, virtual_nodes=2, grace_s=grace_s, poll_s=0.3)
    assert "2 virtual nodes of 2" in backend.ensure_pool("default")
    broker.configure_pool(policy_params={"hysteresis": 0.0, "min_resize_interval_s": 2.0}, lease_s=60)
    return broker, backend


def launch(broker: GpuBroker, backend: LocalBackend, name: str, command: str, min_gpus: int, max_gpus: int,
           steps: int) -> str:
    job = broker.submit(JobSpec(name, command, min_gpus, max_gpus, total_steps=steps, key=name))
    broker.start(job.id, backend.start(job))
    return job.id


def wait(what: str, ok, deadline: float) -> None:
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@dataclass
class GangRun:
    """Jobs started in one :func:`gang_run`, under its :class:`Sampler`, within one deadline."""

    broker: GpuBroker
    backend: LocalBackend
    deadline: float
    job_ids: list[str] = field(default_factory=list)
    sampler: Sampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.broker, self.backend, self.job_ids)

    def launch(self, name: str, command: str, min_gpus: int, max_gpus: int, steps: int) -> str:
        return self.add(launch(self.broker, self.backend, name, command, min_gpus, max_gpus, steps))

    def add(self, job_id: str) -> str:
        """A job started by the test itself, sampled and stopped like the others."""
        self.job_ids.append(job_id)
        return job_id

    def wait(self, what: str, ok) -> None:
        wait(what, ok, self.deadline)

    def ended(self) -> bool:
        return all(self.broker.job(j).status.terminal for j in self.job_ids)


@contextlib.contextmanager
def gang_run(broker: GpuBroker, backend: LocalBackend, deadline_s: float,
             stop_timeout_s: float = 5.0) -> Iterator[GangRun]:
    """Run a test's jobs with a sampler checking that no GPU is in two of them, and stop every
    one of them at the end, whatever happened."""
    run = GangRun(broker, backend, time.monotonic() + deadline_s)
    run.sampler.start()
    try:
        yield run
    finally:
        run.sampler.done.set()
        run.sampler.join(5)
        for j in run.job_ids:
            backend.stop(j, timeout_s=stop_timeout_s)


def nodes_of(data: dict) -> set[str]:
    return {g.split(":")[0] for g in data["gpus"]}


def starts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"event": "start"')]


def test_a_job_larger_than_a_node_needs_the_gang_placeholders(tmp_path):
    broker, _ = gang_setup(tmp_path, 5)
    with pytest.raises(InvalidRequest, match=r"missing \{nnodes\}, \{node_rank\}, \{master_addr\}, \{master_port\}"):
        broker.submit(JobSpec("big", "python train.py", 2, 4, total_steps=10))
    for backend in ("local", "kubernetes"):  # a gang may opt in to suspension on both
        gang = broker.submit(JobSpec(f"big-{backend}", f"python train.py {GANG_ARGS}", 2, 4, total_steps=10,
                                     preemptible=True, backend=backend))
        assert gang.preemptible
        broker.cancel(gang.id)
    on_pods = broker.submit(JobSpec("pods", f"python train.py {GANG_ARGS}", 2, 4, total_steps=10,
                                    backend="kubernetes"))  # one pod per node
    assert on_pods.max_gpus == 4
    broker.cancel(on_pods.id)
    assert broker.submit(JobSpec("small", "python train.py", 1, 2, total_steps=10)).max_gpus == 2


def test_gang_plan_ranks_nodes_and_suspends_the_unused_one(tmp_path):
    dirs = {n: tmp_path / n for n in ("localhost-0", "localhost-1")}
    for d in dirs.values():
        d.mkdir()
    gang = Gang(dirs)
    plan = gang.publish(3, [("localhost-1", 3), ("localhost-1", 2)])
    assert plan == {"localhost-1": {"gpus": [2, 3], "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1",
                                    "master_port": plan["localhost-1"]["master_port"]}}
    assert gang.desired("localhost-0") == {"generation": 3, "stop": False, "gpus": []}  # suspended
    assert gang.rank0 == {3: "localhost-1"} and Gang(dirs).rank0 == {3: "localhost-1"}  # a restarted agent
    command = "torchrun --nnodes={nnodes} --node_rank={node_rank} --rdzv_endpoint={master_addr}:{master_port} x"
    port = plan["localhost-1"]["master_port"]
    assert protocol.expand_command(command, gang.desired("localhost-1")) == (
        f"torchrun --nnodes=1 --node_rank=0 --rdzv_endpoint=127.0.0.1:{port} x")
    with pytest.raises(ValueError, match=r"node\(s\) \['elsewhere'\]"):
        gang.publish(4, [("elsewhere", 0)])
    # one node's trainer failing is the gang's failure, named
    protocol.write_json(dirs["localhost-0"] / protocol.STATUS, {"state": "suspended", "generation": 3})
    protocol.write_json(dirs["localhost-1"] / protocol.STATUS, {"state": "exited", "exit_code": 1, "generation": 3})
    assert gang.status(3)["state"] == "exited" and gang.status(3)["node"] == "localhost-1"



def test_a_gang_runs_a_shrink_only_once_the_dropped_node_has_stopped_its_trainer(tmp_path):
    """A shrink from two nodes to one: the broker frees the dropped node's GPUs on the ack, so the
    gang must not report the generation running while that node's old trainer still runs (a real
    DDP run found a newcomer started on GPUs whose old trainer was still checkpointing)."""
    dirs = {n: tmp_path / n for n in ("localhost-0", "localhost-1")}
    for d in dirs.values():
        d.mkdir()
    gang = Gang(dirs)
    gang.publish(3, [("localhost-0", 0), ("localhost-0", 1)])
    protocol.write_json(dirs["localhost-0"] / protocol.STATUS, {"state": "running", "generation": 3, "pid": 11})
    for old in ({"state": "running", "generation": 2, "pid": 12}, {"state": "stopping", "generation": 2, "pid": 12},
                {"state": "starting", "generation": 0}):
        protocol.write_json(dirs["localhost-1"] / protocol.STATUS, old)
        assert gang.status(3)["state"] == "starting", old
    protocol.write_json(dirs["localhost-1"] / protocol.STATUS, {"state": "suspended", "generation": 3})
    assert gang.status(3)["state"] == "running"

def test_a_gang_shrinks_to_one_node_for_a_newcomer_and_grows_back_to_two(tmp_path):
    broker, backend = gang_setup(tmp_path, grace_s=5)
    trainer = tmp_path / "gang_trainer.py"
    trainer.write_text(STAND_IN_GANG_TRAINER)
    with gang_run(broker, backend, 150) as run:
        a = run.launch("gang", f"{sys.executable} {trainer} 600 {GANG_ARGS}", 2, 4, 600)
        run.wait("the gang runs on 4 GPUs", lambda: len(broker.job(a).in_use_gpus) == 4 and broker.job(a).steps_done > 50)
        b = run.launch("small", f"{sys.executable} {trainer} 100 {GANG_ARGS}", 2, 2, 100)
        run.wait("both end", run.ended)
    sampler = run.sampler
    gang, small = broker.job(a), broker.job(b)
    assert gang.status is JobStatus.SUCCEEDED and small.status is JobStatus.SUCCEEDED, (gang.reason, small.reason)
    assert gang.steps_done == 600 and gang.metrics["accuracy"] == 0.95
    moves = [e.data for e in broker.events(job_id=a) if e.kind in ("start", "resize")]
    sizes = [(d["to_gpus"], len(nodes_of(d))) for d in moves]
    assert sizes[0] == (4, 2) and (2, 1) in sizes and sizes[-1] == (4, 2), sizes  # 2 nodes -> 1 -> 2
    assert backend.log_path(a).parent.parent.name == protocol.NODES and backend.log_tail(a)
    runs = [r for d in sorted((backend.job_dir(a) / protocol.NODES).glob("*")) for r in starts(d / protocol.LOG)]
    assert runs[0]["step"] == 0 and all(r["resumed"] and r["step"] > 0 for r in runs[1:]), runs
    assert {r["nnodes"] for r in runs} == {1, 2} and {r["world_size"] for r in runs} == {2, 4}
    assert sampler.samples > 20 and sampler.violations == []


def test_a_preemptible_gang_is_suspended_on_every_node_and_resumes_from_its_checkpoint(tmp_path):
    """A gang on 2 virtual nodes x 2 GPUs that needs all 4 (min 4) opted in to suspension; a short
    job arrives: every node's trainer checkpoints and stops, the agent acks the generation with no
    GPUs once all of them have (the broker then frees the GPUs), the short job runs, and the gang
    resumes on both nodes from its checkpoint. No GPU is in two jobs throughout."""
    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", default_restart_overhead_s=2.0)
    backend = LocalBackend(tmp_path / "jobs", broker, virtual_gpus=2, virtual_nodes=2, grace_s=5, poll_s=0.3)
    backend.ensure_pool("default")
    broker.configure_pool(policy_params={"suspend": True, "hysteresis": 0.0, "min_runtime_s": 2.0,
                                         "min_resize_interval_s": 2.0}, lease_s=60)
    trainer = tmp_path / "gang_trainer.py"
    trainer.write_text(STAND_IN_GANG_TRAINER)
    with gang_run(broker, backend, 150) as run:
        job = broker.submit(JobSpec("gang", f"{sys.executable} {trainer} 2500 {GANG_ARGS}", 4, 4, total_steps=2500,
                                    key="gang", preemptible=True))
        gang = run.add(job.id)
        broker.start(job.id, backend.start(job))
        run.wait("the gang trains on both nodes", lambda: broker.job(gang).steps_done >= 200)
        short = run.launch("short", f"{sys.executable} {trainer} 40 {GANG_ARGS}", 2, 2, 40)
        run.wait("the gang is suspended", lambda: broker.job(gang).status is JobStatus.SUSPENDED
                 or broker.job(gang).status.terminal)
        assert broker.job(gang).in_use_gpus == () or broker.job(gang).status is JobStatus.SUSPENDED
        run.wait("both end", run.ended)
    sampler = run.sampler
    done = broker.job(gang)
    assert done.status is JobStatus.SUCCEEDED and broker.job(short).status is JobStatus.SUCCEEDED, done.reason
    assert done.steps_done == 2500
    kinds = [e.kind for e in broker.events(job_id=gang)]
    assert "suspend" in kinds and "resume" in kinds[kinds.index("suspend"):], kinds
    runs = [r for d in sorted((backend.job_dir(gang) / protocol.NODES).glob("*")) for r in starts(d / protocol.LOG)]
    resumed = [r for r in runs if r["resumed"]]
    assert resumed and all(r["nnodes"] == 2 and r["step"] >= 200 for r in resumed), runs
    assert sampler.samples > 10 and sampler.violations == []


@pytest.mark.slow
def test_a_real_ddp_job_on_two_virtual_nodes_is_resized_across_nodes_and_resumes(tmp_path):
    """Real PyTorch DDP under ``torchrun --nnodes`` (gloo on the CPU), on 2 virtual nodes x 2 GPUs,
    resized 4 -> 2 -> 4 GPUs while it trains: it starts alone on both nodes, shrinks to one node for
    a newcomer, grows back onto both when the newcomer ends, and resumes from its checkpoint each
    time. The trainer pads each step with ``--step-ms`` (a sleep per worker for its share of the
    batch, standing in for GPU compute this CPU machine lacks), so 4 workers are measured faster
    than 2 and growing back is the policy's own choice, as it would be on GPUs."""
    broker, backend = gang_setup(tmp_path, grace_s=20)
    ddp = (f"{sys.executable} -m torch.distributed.run --nnodes={{nnodes}} --node_rank={{node_rank}} "
           "--nproc_per_node={num_gpus} --rdzv_backend=c10d --rdzv_endpoint={master_addr}:{master_port} "
           f"{TRAIN_SCRIPT} --hidden 128 --checkpoint-every 25 --step-ms 160 --total-steps ")
    stand_in = tmp_path / "gang_trainer.py"
    stand_in.write_text(STAND_IN_GANG_TRAINER)
    release = tmp_path / "release-newcomer"

    def trains_on(job_id: str, gpus: int, steps: float) -> bool:
        job = broker.job(job_id)
        return job.status.terminal or (len(job.in_use_gpus) == gpus and job.steps_done >= steps)

    with gang_run(broker, backend, 540, stop_timeout_s=10) as run:
        try:
            a = run.launch("ddp", ddp + "1500", 2, 4, 1500)
            run.wait("the DDP job trains on two nodes", lambda: trains_on(a, 4, 150))
            newcomer = run.launch("newcomer", f"{sys.executable} {stand_in} 1000000 {GANG_ARGS} --until {release}",
                                  2, 2, 1_000_000)
            run.wait("the DDP job shrinks to one node",
                     lambda: trains_on(a, 2, 0) and broker.job(a).acked_generation >= 2)
            at_shrink = broker.job(a).steps_done  # from here on, steps of the 2-GPU generation only
            run.wait("it trains on one node", lambda: trains_on(a, 2, at_shrink + 100))
            release.touch()  # the newcomer ends: the DDP job grows back onto both nodes
            run.wait("the DDP job runs on two nodes again",
                     lambda: trains_on(a, 4, 0) and broker.job(a).acked_generation >= 3)
            run.wait("all end", run.ended)
        finally:
            release.touch()
    sampler = run.sampler
    job = broker.job(a)
    assert job.status is JobStatus.SUCCEEDED and broker.job(newcomer).status is JobStatus.SUCCEEDED, job.reason
    assert job.steps_done == 1500 and job.metrics["accuracy"] >= 0.9, job.metrics
    moves = [(e.data["to_gpus"], len(nodes_of(e.data))) for e in broker.events(job_id=a) if e.kind in ("start", "resize")]
    assert moves[:3] == [(4, 2), (2, 1), (4, 2)], moves
    runs = [r for d in sorted((backend.job_dir(a) / protocol.NODES).glob("*"))
            for r in starts(d / protocol.LOG)]
    runs.sort(key=lambda r: r["step"])
    assert sampler.samples > 50 and sampler.violations == []
    assert len(runs) >= 3 and runs[0]["step"] == 0 and all(r["resumed"] and r["step"] > 0 for r in runs[1:]), runs
    assert [r["world_size"] for r in runs[:3]] == [4, 2, 4], runs


@pytest.mark.slow
def test_a_preemptible_real_trainer_is_suspended_for_a_short_job_and_resumes_from_its_checkpoint(tmp_path):
    """Suspension end to end with the real PyTorch trainer under torchrun (2 virtual GPUs, one node):
    a short job arrives while a long preemptible one holds every GPU; the broker (pool setting
    ``suspend``) takes the long job to zero GPUs (its trainer checkpoints on SIGTERM and its launcher
    waits), runs the short job, then resumes the long one from its checkpoint; the sampler finds no
    GPU in two jobs throughout."""
    # a restart assumed to cost 2 s until measured: the suspension pays however fast this machine
    # trains (with the default 10 s it paid only while the long job had more than ~20 s to go); the
    # long job's own start, measured, can take 10-20 s on a loaded machine (two slow tests at once),
    # so it has 16,000 steps and the pool rebalances every 2 s: with 12,000 steps and the default
    # 10 s, the first rebalance after its 5 s minimum runtime came 15 s in, and on a fast machine
    # (12,000 steps in 37 s) the ~20 s left no longer paid for two measured ~10 s restarts
    broker = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", default_restart_overhead_s=2.0)
    broker.register_node("localhost", 2)
    broker.configure_pool(policy_params={"suspend": True, "hysteresis": 0.0, "min_runtime_s": 5.0,
                                         "min_resize_interval_s": 2.0}, lease_s=60, rebalance_interval_s=2.0)
    backend = LocalBackend(tmp_path / "jobs", broker, grace_s=20, poll_s=0.3)
    ddp = (f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}} "
           f"{TRAIN_SCRIPT} --hidden 128 --checkpoint-every 25 --total-steps 16000")
    stand_in = tmp_path / "gang_trainer.py"
    stand_in.write_text(STAND_IN_GANG_TRAINER)
    with gang_run(broker, backend, 420, stop_timeout_s=10) as run:
        long = broker.submit(JobSpec("long", ddp, 2, 2, total_steps=16000, key="long", preemptible=True))
        run.add(long.id)
        broker.start(long.id, backend.start(long))
        run.wait("the long job trains", lambda: broker.job(long.id).steps_done >= 150
                 or broker.job(long.id).status.terminal)
        short = run.launch("short", f"{sys.executable} {stand_in} 60 {GANG_ARGS}", 2, 2, 60)
        run.wait("the long job is suspended", lambda: broker.job(long.id).status is JobStatus.SUSPENDED
                 or broker.job(long.id).status.terminal)
        at_suspension = broker.job(long.id).steps_done
        run.wait("both end", run.ended)
    sampler = run.sampler
    job = broker.job(long.id)
    assert job.status is JobStatus.SUCCEEDED and broker.job(short).status is JobStatus.SUCCEEDED, job.reason
    assert job.steps_done == 16000 and job.metrics["accuracy"] >= 0.9, job.metrics
    kinds = [e.kind for e in broker.events(job_id=long.id)]
    assert "suspend" in kinds and "resume" in kinds[kinds.index("suspend"):], kinds
    log = (backend.job_dir(long.id) / protocol.LOG).read_text().splitlines()
    runs = starts(backend.job_dir(long.id) / protocol.LOG)
    stopped = [json.loads(line)["step"] for line in log if line.startswith('{"event": "stopped"')]
    assert len(runs) >= 2 and runs[0]["step"] == 0 and stopped, (runs, stopped)
    resumed = runs[1]  # from the checkpoint it wrote on SIGTERM (the broker's count lags a little)
    assert resumed["resumed"] and resumed["step"] == stopped[0] >= at_suspension > 0, (resumed, stopped, at_suspension)
    short_start = min(e.time_s for e in broker.events(job_id=short) if e.kind == "start")
    long_resume = min(e.time_s for e in broker.events(job_id=long.id) if e.kind == "resume")
    assert short_start < long_resume  # the short job ran while the long one was suspended
    assert sampler.samples > 20 and sampler.violations == []


def test_a_gang_reports_its_end_only_once_a_dropped_nodes_trainer_has_stopped(tmp_path):
    """The gang's last generation dropped a node whose old trainer still checkpoints when the
    others exit with 0: the broker frees every node's GPUs on the end report, so the agent waits for
    that trainer to stop before it reports."""
    import threading
    import time

    from airflow_elastic_gpu.sidecar.agent import Agent

    class Broker:
        finished_s = None

        def progress(self, *args, **kwargs):
            return None

        def finish(self, job_id, exit_code=0, metrics=None, *, node=None):
            Broker.finished_s = time.monotonic()

    dirs = {n: tmp_path / protocol.NODES / n for n in ("localhost-0", "localhost-1")}
    for d in dirs.values():
        d.mkdir(parents=True)
    agent = Agent(Broker(), "j", tmp_path, poll_s=0.05, stop_timeout_s=10)
    agent.gang.publish(3, [("localhost-0", 0), ("localhost-0", 1)])
    agent.written = 3
    protocol.write_json(dirs["localhost-0"] / protocol.STATUS, {"state": "exited", "exit_code": 0, "generation": 3})
    (dirs["localhost-0"] / protocol.LOG).write_text('{"final": true, "step": 10, "accuracy": 0.9}\n')
    protocol.write_json(dirs["localhost-1"] / protocol.STATUS, {"state": "stopping", "generation": 2, "pid": 12})
    stopped_s = []

    def dropped_node_stops():
        time.sleep(0.5)
        stopped_s.append(time.monotonic())
        protocol.write_json(dirs["localhost-1"] / protocol.STATUS, {"state": "stopped", "generation": 3})

    threading.Thread(target=dropped_node_stops).start()
    assert agent._report_exit(0) == 0
    assert Broker.finished_s is not None and stopped_s and Broker.finished_s >= stopped_s[0]
