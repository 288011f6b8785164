"""Two trainings share 4 virtual GPUs through the broker and the local backend.

The broker shrinks the first job to admit the second and grows the second when
the first ends; both resume from their checkpoints; a sampler checks throughout
that no GPU is used by two jobs, both in the broker's in-use sets and in the
trainer processes' CUDA_VISIBLE_DEVICES. The default suite runs this with a
stand-in trainer (a checkpointing step loop whose speed grows with its GPU
count, ~20 s); ``make test-all`` also runs it with two real PyTorch DDP
trainings under ``torchrun`` that must reach >= 0.9 accuracy (~2.5 min on 2 cores).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TRAIN_SCRIPT

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol


def trainer_devices(job_dir: Path) -> set[int] | None:
    """The GPU indices the job's live trainer process was started with, or None if none runs."""
    status = protocol.read_json(job_dir / protocol.STATUS) or {}
    pid = status.get("pid")
    if not pid or status.get("state") not in (protocol.RUNNING, protocol.STOPPING):
        return None
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for item in env:
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            value = item.split(b"=", 1)[1].decode()
            return {int(x) for x in value.split(",") if x}
    return None


class InvariantSampler(threading.Thread):
    def __init__(self, broker: GpuBroker, backend: LocalBackend, job_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.broker, self.backend, self.job_ids = broker, backend, job_ids
        self.samples = 0
        self.violations: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            devices = {j: trainer_devices(self.backend.job_dir(j)) for j in list(self.job_ids)}
            live = [(j, d) for j, d in devices.items() if d]
            for i, (a, da) in enumerate(live):
                for b, db in live[i + 1:]:
                    if da & db:
                        self.violations.append(f"trainers of {a} and {b} share GPUs {da & db}")
            in_use = [g for v in self.broker.jobs() for g in v.in_use_gpus]
            if len(in_use) != len(set(in_use)):
                self.violations.append(f"broker in-use sets overlap: {in_use}")
            self.samples += 1
            time.sleep(0.2)


def training_log_starts(job_dir: Path) -> list[dict]:
    out = []
    for line in (job_dir / protocol.LOG).read_text().splitlines():
        if line.startswith('{"event": "start"'):
            out.append(json.loads(line))
    return out


STAND_IN_TRAINER = """
import json, os, signal, sys, time
from pathlib import Path
ckpt = Path(os.environ["ELASTIC_CHECKPOINT_DIR"]) / "step"
total, gpus = int(sys.argv[1]), int(os.environ["ELASTIC_GPU_COUNT"])
step = int(ckpt.read_text()) if ckpt.exists() else 0
print(json.dumps({"event": "start", "step": step, "world_size": gpus, "resumed": ckpt.exists()}), flush=True)

def stop(*_):
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_text(str(step))
    sys.exit(143)

signal.signal(signal.SIGTERM, stop)
while step < total:
    time.sleep(0.08 / gpus)  # a step: linear speed-up in the GPU count
    step += 1
    print(json.dumps({"step": step}), flush=True)
print(json.dumps({"final": True, "step": step, "accuracy": 0.95}), flush=True)
"""


def run_two_jobs_that_must_share(tmp_path: Path, command: str, steps: tuple[int, int], grace_s: float,
                                 deadline_s: float) -> tuple[GpuBroker, LocalBackend, str, str, InvariantSampler]:
    """Start job "first" (1-4 GPUs) alone on 4 GPUs, submit "second" once it has done a third of its
    steps, and wait until both have ended; ``command`` + the step count is each job's command."""
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = GpuBroker(url)
    broker.register_node("localhost", 4)
    broker.configure_pool(policy_params={"hysteresis": 0.0, "min_resize_interval_s": 2.0}, lease_s=60)
    backend = LocalBackend(tmp_path / "jobs", broker, grace_s=grace_s, poll_s=0.3)
    job_ids: list[str] = []
    sampler = InvariantSampler(broker, backend, job_ids)

    def launch(name: str, steps: int) -> str:
        job = broker.submit(JobSpec(name, command + str(steps), 1, 4, total_steps=steps, key=name))
        broker.start(job.id, backend.start(job))
        job_ids.append(job.id)
        return job.id

    try:
        a = launch("first", steps[0])
        sampler.start()
        deadline = time.monotonic() + deadline_s
        while broker.job(a).steps_done < steps[0] // 3:
            assert time.monotonic() < deadline, "first job made no progress"
            assert not broker.job(a).status.terminal, broker.job(a).reason
            time.sleep(0.3)
        b = launch("second", steps[1])
        while not all(broker.job(j).status.terminal for j in (a, b)):
            assert time.monotonic() < deadline, [broker.job(j) for j in (a, b)]
            time.sleep(0.3)
    finally:
        sampler.done.set()
        sampler.join(5)
        for j in job_ids:
            backend.stop(j, timeout_s=5)
    return broker, backend, a, b, sampler


def assert_shrunk_to_admit_then_grown_and_resumed(broker: GpuBroker, backend: LocalBackend, a: str, b: str,
                                                  sampler: InvariantSampler, min_samples: int) -> None:
    first, second = broker.job(a), broker.job(b)
    for job in (first, second):
        assert job.status is JobStatus.SUCCEEDED, job.reason
        assert job.steps_done == job.total_steps
        assert job.metrics["accuracy"] >= 0.9, job.metrics
    resizes = {j: [e.data for e in broker.events(job_id=j) if e.kind == "resize"] for j in (a, b)}
    assert any(d["to_gpus"] < d["from_gpus"] for d in resizes[a]), resizes
    assert any(d["to_gpus"] > d["from_gpus"] for d in resizes[b]), "\n".join(str(x) for x in [
        (round(e.time_s - first.submit_s, 1), e.kind, e.job_id == a, e.message) for e in broker.events()] + [second.throughput])
    assert first.num_resizes >= 1 and second.num_resizes >= 1
    for j in (a, b):  # each restart resumed from a checkpoint, not from step 0
        starts = training_log_starts(backend.job_dir(j))
        assert len(starts) >= 2 and starts[0]["step"] == 0
        assert all(s["resumed"] and s["step"] > 0 for s in starts[1:]), starts
    assert sampler.samples > min_samples and sampler.violations == []


def test_two_trainings_share_four_virtual_gpus_and_are_resized(tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(STAND_IN_TRAINER)
    # the second outlasts the first even on 1 GPU, so it is still running when the first ends
    run = run_two_jobs_that_must_share(tmp_path, f"{sys.executable} {trainer} ", (240, 400), grace_s=5,
                                       deadline_s=120)
    assert_shrunk_to_admit_then_grown_and_resumed(*run, min_samples=20)


@pytest.mark.slow
def test_two_real_trainings_share_four_virtual_gpus_and_are_resized(tmp_path):
    command = (f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}} "
               f"{TRAIN_SCRIPT} --hidden 128 --checkpoint-every 25 --total-steps ")
    # the second outlasts the first even alone on 1 GPU (one process has no all-reduce)
    run = run_two_jobs_that_must_share(tmp_path, command, (300, 15000), grace_s=20, deadline_s=540)
    assert_shrunk_to_admit_then_grown_and_resumed(*run, min_samples=50)
