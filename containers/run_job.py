"""Run a real elastic training job as the Kubernetes backend's generated pod, with podman.

The broker (SQLite) and its HTTP API run on this host, the API on 127.0.0.1 only; the pod, in its
own network namespace, reaches it at :data:`podman_core.HOST_FROM_POD` (as a cluster's pods reach
the broker's Service). The project's
:class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesBackend` builds the pod (images: the
local tags of ``make images``) and creates, watches and deletes it through
:class:`podman_core.PodmanCoreV1` (``podman kube play``). One virtual node with two "GPUs" (the
trainer runs on CPU: one DDP worker per GPU). Once the job has trained a fifth of its steps a
one-GPU job is submitted (the job shrinks 2 -> 1); a fifth of the steps after that resize it is
cancelled (the job grows back 1 -> 2). In ``inplace`` mode the trainer container's launcher
restarts the trainer inside the same pod, in ``recreate`` mode the pod is replaced. The checkpoint
directory is a ``hostPath`` volume (a cluster would use a PersistentVolumeClaim) so that a
re-created pod resumes from it.

Each resize is timed from the trainer's container log (podman's timestamps of the launcher's echo):
the new generation's first training step, minus the generation's publication by the broker
(in place) or the old pod's deletion call (re-creation).

Usage: ``python containers/run_job.py [--mechanism inplace|recreate] [--total-steps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from podman_core import HOST_FROM_POD, PodmanCoreV1

from airflow_elastic_gpu.backends.kubernetes import (
    KubernetesBackend,
    KubernetesJobConfig,
    resource_name,
)
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.triggers.watcher import JobWatcher

AGENT_IMAGE = "localhost/airflow-elastic-gpu-agent:dev"
TRAINER_IMAGE = "localhost/airflow-elastic-gpu-trainer:dev"
NODE = "podman-node-0"
STEP_MS = 100
"""Each training step takes at least this long on one GPU, half of it on two (``--step-ms`` of the
trainer): an even pace, so that the run's resizes land mid-training on any machine."""


@dataclass
class Resize:
    """One resize of the run, from the broker's publication to the new trainer's first step.

    Times are epoch seconds on this host; ``None`` where the log did not show it.
    :param stopped_step: the step the old trainer checkpointed at when it was stopped (SIGTERM).
    :param resumed_step: the step the new trainer resumed from (its checkpoint).
    """

    generation: int
    from_gpus: int
    to_gpus: int
    published_at: float
    pod_deleted_at: float | None = None
    first_step_at: float | None = None
    stopped_step: int | None = None
    resumed_step: int | None = None

    @property
    def overhead_s(self) -> float | None:
        """In place: publication -> first step; re-creation: old pod's deletion -> new pod's first step."""
        start = self.pod_deleted_at if self.pod_deleted_at is not None else self.published_at
        return None if self.first_step_at is None else self.first_step_at - start

    @property
    def from_publication_s(self) -> float | None:
        """Publication -> first step, in either mode."""
        return None if self.first_step_at is None else self.first_step_at - self.published_at


@dataclass
class PodRun:
    """What one containerised run showed (seconds are wall-clock on this host)."""

    mechanism: str
    status: str
    accuracy: float | None
    steps_done: float
    total_steps: int
    num_resizes: int
    generations: int
    pods_created: int
    first_step_s: float | None  # the first pod's kube play -> its first training step
    resizes: list[Resize] = field(default_factory=list)
    pod_delete_s: list[float] = field(default_factory=list)  # each deleted pod: SIGTERM -> removed
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        for entry, resize in zip(data["resizes"], self.resizes, strict=True):
            entry.update(overhead_s=resize.overhead_s, from_publication_s=resize.from_publication_s)
        return data


def say(message: str) -> None:
    print(f"[pod] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api(broker_url: str, port: int) -> subprocess.Popen[bytes]:
    """``airflow-elastic-gpu broker serve`` on 127.0.0.1:``port``; returns once it answers.

    :raises RuntimeError: it did not answer within 60 s (it is stopped).
    """
    proc = subprocess.Popen([sys.executable, "-c", "from airflow_elastic_gpu.cli import main; main()",
                             "--broker-url", broker_url, "broker", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the broker API did not answer within 60 s")


def read_logs(core: PodmanCoreV1, pods: list[str], resizes: dict[int, Resize]) -> float | None:
    """Fill each resize's first step, stopped and resumed steps from the pods' trainer logs;
    return the time of the first pod's first step."""
    first_step_at: dict[int, float] = {}
    generation = 0
    for name in pods:
        for at, line in core.trainer_log(name):
            marked = protocol.parse_generation_line(line)
            if marked is not None:
                generation = marked
                continue
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            nxt = resizes.get(generation + 1)
            if event.get("event") == "stopped" and nxt is not None:
                nxt.stopped_step = int(event["step"])
            elif event.get("event") == "start" and generation in resizes:
                resizes[generation].resumed_step = int(event["step"])
            elif "step" in event and "event" not in event and "final" not in event:
                first_step_at.setdefault(generation, at)
    for gen, resize in resizes.items():
        resize.first_step_at = first_step_at.get(gen)
    return first_step_at.get(1)


def run(mechanism: str = "inplace", total_steps: int = 600, timeout_s: float = 900, keep: bool = False) -> PodRun:
    """Train one job to the end as a podman pod, resized 2 -> 1 -> 2 GPUs; see the module docstring.

    Every pod, the broker API and (unless ``keep``) the work directory are removed at the end, also
    on an error or SIGTERM.

    :raises RuntimeError: the job did not end within ``timeout_s`` seconds, or the API did not start.
    """
    work = Path(tempfile.mkdtemp(prefix="aeg-pod-"))
    checkpoints = work / "checkpoints"
    checkpoints.mkdir()
    if os.geteuid() == 0:
        os.chown(checkpoints, 1000, 1000)
    url = f"sqlite:///{work / 'broker.db'}"
    broker = GpuBroker(url)
    broker.register_node(NODE, 2, gpu_type="virtual")
    broker.configure_pool(policy_params={"hysteresis": 0.0, "min_resize_interval_s": 0.0})
    port = free_port()
    core = PodmanCoreV1(work)
    config = KubernetesJobConfig(
        image=TRAINER_IMAGE, agent_image=AGENT_IMAGE, broker_api_url=f"http://{HOST_FROM_POD}:{port}",
        resize_mechanism=mechanism, runtime_class_name=None, on_finish_action="delete_pod",
        volumes=({"name": "checkpoints", "hostPath": {"path": str(checkpoints), "type": "Directory"}},),
        volume_mounts=({"name": "checkpoints", "mountPath": "/checkpoints"},))
    backend = KubernetesBackend(config, broker, core)
    command = ("python -m torch.distributed.run --standalone --nproc_per_node={num_gpus} /app/train_digits.py "
               f"--total-steps {total_steps} --step-ms {STEP_MS} --checkpoint-every 20 --log-every 1")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    api = None
    started = time.monotonic()
    try:
        api = start_api(url, port)
        job = broker.submit(JobSpec("podman-digits", command, 1, 2, total_steps=total_steps, backend="kubernetes",
                                    checkpoint_dir="/checkpoints"))
        broker.start(job.id, backend.start(job))
        say(f"job {job.id}: pod {next(iter(core.pods))} played ({mechanism})")
        resizes = _train(broker, backend, job.id, total_steps, started + timeout_s)
        view = broker.job(job.id)
        pods = list(core.created_at)
        backend.stop(job.id, succeeded=view.status == "succeeded")
        for resize in resizes.values():
            resize.pod_deleted_at = core.deleted_at.get(resource_name("elastic-gpu", job.id, resize.generation - 1)) \
                if mechanism == "recreate" else None
        first_at = read_logs(core, pods, resizes)
        if keep:
            for name in pods:
                (work / f"{name}.log").write_text("".join(f"{at:.3f} {line}\n" for at, line in core.trainer_log(name)))
        say(f"job {view.status}: steps {view.steps_done:.0f}/{total_steps}, resizes {view.num_resizes}, "
            f"metrics {view.metrics}")
        for r in resizes.values():
            say(f"generation {r.generation} ({r.from_gpus} -> {r.to_gpus} GPUs): stopped at step {r.stopped_step}, "
                f"resumed at step {r.resumed_step}, overhead {_seconds(r.overhead_s)}"
                + (f" (publication -> first step {_seconds(r.from_publication_s)})" if mechanism == "recreate" else ""))
        if view.status != "succeeded":
            for name in pods:
                say(f"trainer log of {name}:\n" + "\n".join(line for _, line in core.trainer_log(name)[-40:]))
        return PodRun(mechanism, str(view.status), (view.metrics or {}).get("accuracy"), view.steps_done,
                      total_steps, view.num_resizes, view.target_generation, len(pods),
                      None if first_at is None else first_at - core.created_at[pods[0]], list(resizes.values()),
                      list(core.delete_s.values()), time.monotonic() - started)
    finally:
        core.delete_all()
        if api is not None:
            api.terminate()
            api.wait(timeout=30)
        broker.engine.dispose()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if keep:
            say(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _train(broker: GpuBroker, backend: KubernetesBackend, job_id: str, total_steps: int,
           deadline: float) -> dict[int, Resize]:
    """Sync the pods with the broker until the job ends, resizing it 2 -> 1 -> 2 GPUs on the way;
    the resizes by generation.

    :raises RuntimeError: the job did not end by ``deadline`` (monotonic seconds).
    """
    resizes: dict[int, Resize] = {}
    filler = None
    shrunk_at_step: float | None = None
    watcher = JobWatcher(broker, backend, job_id)
    while time.monotonic() < deadline:
        view = broker.job(job_id)
        if view.status.terminal:
            return resizes
        action = backend.sync(view)
        if action in ("create", "recreate"):
            say(f"{action}: pod for generation {broker.job(job_id).target_generation}")
        watcher.end_if_broken(view)  # as a task's watcher ends it: the next poll reads the end
        if filler is None and view.steps_done >= total_steps / 5:
            filler = broker.submit(JobSpec("filler", "sleep 1", 1, 1, total_steps=1))
            resizes.update(_published(broker, job_id, view, "a 1-GPU job arrives"))
        elif filler is not None and shrunk_at_step is None and resizes and \
                view.acked_generation >= max(resizes):
            shrunk_at_step = view.steps_done
        elif shrunk_at_step is not None and not broker.job(filler.id).status.terminal and \
                view.steps_done >= shrunk_at_step + total_steps / 5:
            broker.cancel(filler.id)
            # the filler has no trainer (nothing ever ran it): report it stopped, as its agent would
            # once its trainer was gone; until then the broker keeps a cancelled job's GPUs
            broker.fail(filler.id, "its trainer stopped (it never ran one)")
            resizes.update(_published(broker, job_id, view, "it is cancelled"))
        time.sleep(0.5)
    raise RuntimeError(f"job {job_id} did not end in time")


def _published(broker: GpuBroker, job_id: str, before, why: str) -> dict[int, Resize]:
    after = broker.job(job_id)
    say(f"step {before.steps_done:.0f}: {why} -> generation {after.target_generation} with "
        f"{len(after.target_gpus)} GPU(s)")
    if after.target_generation == before.target_generation:
        return {}
    return {after.target_generation: Resize(after.target_generation, len(before.target_gpus),
                                            len(after.target_gpus), time.time())}


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f} s"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s clean-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanism", choices=["inplace", "recreate"], default="inplace")
    parser.add_argument("--total-steps", type=int, default=600)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (broker DB, manifests)")
    args = parser.parse_args(argv)
    result = run(args.mechanism, args.total_steps, keep=args.keep)
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.status == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
