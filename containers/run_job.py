"""Run a real elastic training job as the Kubernetes backend's generated pod, with podman.

The broker (SQLite) and its HTTP API run on this host (127.0.0.1); the project's
:class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesBackend` builds the pod (images: the
local tags of ``make images``) and creates, watches and deletes it through
:class:`podman_core.PodmanCoreV1` (``podman kube play --network host``). One virtual node with two
"GPUs" (the trainer runs on CPU: one DDP worker per GPU). While it trains, a one-GPU job is
submitted (the job shrinks 2 -> 1) and cancelled (it grows back 1 -> 2); in ``inplace`` mode the
trainer container restarts inside the same pod, in ``recreate`` mode the pod is replaced. The
checkpoint directory is a ``hostPath`` volume (a cluster would use a PersistentVolumeClaim) so that
a re-created pod resumes from it.

Usage: ``python containers/run_job.py [--mechanism inplace|recreate] [--total-steps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from podman_core import PodmanCoreV1  # noqa: E402

from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig  # noqa: E402
from airflow_elastic_gpu.broker.service import GpuBroker  # noqa: E402
from airflow_elastic_gpu.broker.types import JobSpec  # noqa: E402

AGENT_IMAGE = "localhost/airflow-elastic-gpu-agent:dev"
TRAINER_IMAGE = "localhost/airflow-elastic-gpu-trainer:dev"
NODE = "podman-node-0"


@dataclass(frozen=True)
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
    restart_overhead_s: float | None
    first_pod_to_first_step_s: float | None
    pod_delete_s: list[float]
    wall_s: float


def say(message: str) -> None:
    print(f"[pod] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api(broker_url: str, port: int) -> subprocess.Popen[bytes]:
    """``airflow-elastic-gpu broker serve`` on 127.0.0.1:``port``; returns once it answers."""
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


def run(mechanism: str = "inplace", total_steps: int = 300, timeout_s: float = 900) -> PodRun:
    """Train one job to the end as a podman pod, resized 2 -> 1 -> 2 GPUs; see the module docstring.

    :raises RuntimeError: the job did not end within ``timeout_s`` seconds.
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
    api = start_api(url, port)
    core = PodmanCoreV1(work)
    config = KubernetesJobConfig(
        image=TRAINER_IMAGE, agent_image=AGENT_IMAGE, broker_api_url=f"http://127.0.0.1:{port}",
        resize_mechanism=mechanism, runtime_class_name=None, on_finish_action="delete_pod",
        volumes=({"name": "checkpoints", "hostPath": {"path": str(checkpoints), "type": "Directory"}},),
        volume_mounts=({"name": "checkpoints", "mountPath": "/checkpoints"},))
    backend = KubernetesBackend(config, broker, core)
    command = ("python -m torch.distributed.run --standalone --nproc_per_node={num_gpus} /app/train_digits.py "
               f"--total-steps {total_steps} --checkpoint-every 20 --log-every 10")
    started = time.monotonic()
    job = broker.submit(JobSpec("podman-digits", command, 1, 2, total_steps=total_steps, backend="kubernetes",
                                checkpoint_dir="/checkpoints"))
    filler = None
    first_step_s = None
    try:
        broker.start(job.id, backend.start(job))
        say(f"job {job.id}: pod {next(iter(core.pods))} played ({mechanism})")
        while time.monotonic() - started < timeout_s:
            view = broker.job(job.id)
            if view.status.terminal:
                break
            if first_step_s is None and view.steps_done > 0:
                first_step_s = time.monotonic() - started
            action = backend.sync(view)
            if action in ("create", "recreate"):
                say(f"{action}: pod for generation {view.target_generation}")
            problem = backend.problem(view)
            if problem is not None:
                broker.fail(job.id, problem.reason if hasattr(problem, "reason") else str(problem))
                break
            if filler is None and view.steps_done >= total_steps / 3:
                filler = broker.submit(JobSpec("filler", "sleep 1", 1, 1, total_steps=1))
                say(f"step {view.steps_done:.0f}: a 1-GPU job arrives -> target generation "
                    f"{broker.job(job.id).target_generation} with {len(broker.job(job.id).target_gpus)} GPU(s)")
            elif filler is not None and not broker.job(filler.id).status.terminal and \
                    view.steps_done >= 2 * total_steps / 3:
                broker.cancel(filler.id)
                say(f"step {view.steps_done:.0f}: it is cancelled -> target generation "
                    f"{broker.job(job.id).target_generation} with {len(broker.job(job.id).target_gpus)} GPU(s)")
            time.sleep(1.0)
        else:
            raise RuntimeError(f"job {job.id} did not end within {timeout_s} s")
        view = broker.job(job.id)
        say(f"job {view.status}: steps {view.steps_done:.0f}/{total_steps}, resizes {view.num_resizes}, "
            f"metrics {view.metrics}, restart overhead {view.restart_overhead_s}")
        if view.status != "succeeded":
            for name in core.pods:
                say(f"trainer log of {name}:\n{core.trainer_log(name)[-3000:]}")
        pods_created = len(core.created_s)
        backend.stop(job.id, succeeded=view.status == "succeeded")
        return PodRun(mechanism, str(view.status), (view.metrics or {}).get("accuracy"), view.steps_done,
                      total_steps, view.num_resizes, view.target_generation, pods_created,
                      view.restart_overhead_s, first_step_s, list(core.deleted_s.values()),
                      time.monotonic() - started)
    finally:
        for name in list(core.pods):
            core.delete_namespaced_pod(name, "default")
        api.terminate()
        api.wait(timeout=30)
        broker.engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanism", choices=["inplace", "recreate"], default="inplace")
    parser.add_argument("--total-steps", type=int, default=300)
    args = parser.parse_args(argv)
    result = run(args.mechanism, args.total_steps)
    print(json.dumps(asdict(result), indent=2))
    return 0 if result.status == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
