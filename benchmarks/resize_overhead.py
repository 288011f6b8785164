"""Benchmark: training time lost by one in-place stop-and-restart resize, vs starting the job from scratch.

Runs the real elastic trainer (``examples/train_digits.py`` under ``torchrun``)
through the real launcher, and measures from the launcher's log:

* ``cold_start_s``: launch -> first training step done, for a job started from
  nothing at the target GPU count (what any new job, or a termination-based
  re-creation before its pod/image costs, pays);
* ``resize_overhead_s``: new generation written -> first step done after the
  restart, for an in-place resize from ``--from-gpus`` to ``--to-gpus`` GPUs
  (SIGTERM, checkpoint, exit, restart, resume);
* ``steps_lost``: steps redone after the resize (0 when the trainer checkpoints on SIGTERM);
* ``recreate_steps_lost``: steps redone when the trainer is killed without its
  SIGTERM checkpoint (a re-created pod after eviction), from the last periodic checkpoint.

Each is the median of ``--runs`` runs (default 5). Results go to
``benchmarks/results/resize_overhead.json``; the simulator reads
``resize_overhead_s`` as its default in-place restart overhead.

    python benchmarks/resize_overhead.py [--runs 5] [--from-gpus 1] [--to-gpus 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from airflow_elastic_gpu.sidecar import protocol

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_digits.py"
RESULTS = REPO / "benchmarks" / "results" / "resize_overhead.json"
_STEP = re.compile(r'^\{"step": (\d+)')
_START = re.compile(r'^\{"event": "start", "step": (\d+)')


def _launch(shared: Path, gpus: int, steps: int, checkpoint_every: int) -> tuple[subprocess.Popen, float]:
    shared.mkdir(parents=True)
    cmd = _command(steps, checkpoint_every)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "airflow_elastic_gpu.sidecar.launcher", "--shared-dir",
                             str(shared), "--grace-s", "30", "--poll-s", "0.02", "--", cmd], env=env)
    t0 = time.monotonic()
    protocol.write_json(shared / protocol.DESIRED, {"generation": 1, "gpus": list(range(gpus)), "stop": False})
    return proc, t0


def _command(steps: int = 100_000, checkpoint_every: int = 50) -> str:
    return (f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node={{num_gpus}} {TRAIN} "
            f"--total-steps {steps} --log-every 1 --checkpoint-every {checkpoint_every}")


def _steps(shared: Path) -> list[int]:
    path = shared / protocol.LOG
    text = path.read_text() if path.exists() else ""
    return [int(m.group(1)) for line in text.splitlines() if (m := _STEP.match(line))]


def _wait(pred, timeout_s: float = 300.0, poll_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError("benchmark run stalled")


def cold_start(work: Path, gpus: int) -> float:
    proc, t0 = _launch(work, gpus, steps=5, checkpoint_every=1000)
    _wait(lambda: _steps(work))
    elapsed = time.monotonic() - t0
    proc.wait(120)
    return elapsed


def in_place_resize(work: Path, from_gpus: int, to_gpus: int, kill: bool = False) -> tuple[float, int]:
    """Seconds from the new generation to the first step after restart, and the steps redone."""
    proc, _ = _launch(work, from_gpus, steps=100_000, checkpoint_every=50)
    _wait(lambda: len(_steps(work)) >= 75)
    if kill:  # eviction, then re-creation: no SIGTERM checkpoint, a fresh launcher
        status = protocol.read_json(work / protocol.STATUS)
        # an eviction kills the whole pod: torchrun and its workers (each in its own session)
        protocol.signal_processes([status["pid"], *protocol.descendants(status["pid"])], 9)
        proc.wait(60)
        # torchrun's workers can outlive their killed parent for a moment: wait until the log is quiet
        quiet_since, seen = time.monotonic(), len(_steps(work))
        while time.monotonic() - quiet_since < 2.0:
            time.sleep(0.1)
            if len(_steps(work)) != seen:
                quiet_since, seen = time.monotonic(), len(_steps(work))
        for name in (protocol.DESIRED, protocol.STATUS):
            (work / name).unlink()
        proc = subprocess.Popen([sys.executable, "-m", "airflow_elastic_gpu.sidecar.launcher", "--shared-dir",
                                 str(work), "--grace-s", "30", "--poll-s", "0.02", "--", _command()],
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    before = max(_steps(work))
    t0 = time.monotonic()
    protocol.write_json(work / protocol.DESIRED, {"generation": 2, "gpus": list(range(to_gpus)), "stop": False})

    def new_start(lines: list[str]) -> int | None:
        """Index of the new generation's trainer start line (after the launcher's marker)."""
        marks = [i for i, line in enumerate(lines) if "generation 2: starting" in line]
        if not marks:
            return None
        return next((i for i in range(marks[-1], len(lines)) if _START.match(lines[i])), None)

    def after_restart() -> list[str] | None:
        lines = (work / protocol.LOG).read_text().splitlines()
        start = new_start(lines)
        if start is not None and any(_STEP.match(line) for line in lines[start:]):
            return lines
        return None
    lines = _wait(after_restart)
    elapsed = time.monotonic() - t0
    mark = new_start(lines)
    assert mark is not None
    done_before = max([before] + [int(m.group(1)) for line in lines[:mark] if (m := _STEP.match(line))])
    stopped = [json.loads(line)["step"] for line in lines[:mark] if line.startswith('{"event": "stopped"')]
    starts = [int(m.group(1)) for line in lines[mark:] if (m := _START.match(line))]
    first_step = next(int(m.group(1)) for line in lines[mark:] if (m := _STEP.match(line)))
    resume_step = starts[0] if starts else first_step - 1
    redone = max(stopped + [done_before]) - resume_step
    protocol.write_json(work / protocol.DESIRED, {"generation": 2, "gpus": list(range(to_gpus)), "stop": True})
    proc.wait(120)
    time.sleep(0.5)  # let torchrun's workers finish exiting before the directory is removed
    return elapsed, max(0, redone)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--from-gpus", type=int, default=1)
    p.add_argument("--to-gpus", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    console = Console()
    cold, resize, lost, kill_lost = [], [], [], []
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, Progress(console=console) as progress:
        task = progress.add_task("resize-overhead runs", total=3 * args.runs)
        for i in range(args.runs):
            cold.append(cold_start(Path(tmp) / f"cold{i}", args.to_gpus))
            progress.advance(task)
            seconds, redone = in_place_resize(Path(tmp) / f"resize{i}", args.from_gpus, args.to_gpus)
            resize.append(seconds)
            lost.append(redone)
            progress.advance(task)
            kill_lost.append(in_place_resize(Path(tmp) / f"kill{i}", args.from_gpus, args.to_gpus, kill=True)[1])
            progress.advance(task)
    result = {
        "runs": args.runs,
        "from_gpus": args.from_gpus,
        "to_gpus": args.to_gpus,
        "cold_start_s": statistics.median(cold),
        "resize_overhead_s": statistics.median(resize),
        "steps_lost": statistics.median(lost),
        "recreate_steps_lost": statistics.median(kill_lost),
        "samples": {"cold_start_s": cold, "resize_overhead_s": resize, "steps_lost": lost,
                    "recreate_steps_lost": kill_lost},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "gpu": "virtual (CPU, gloo)" if not _has_cuda() else "cuda"},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"resize overhead, median of {args.runs} runs ({args.from_gpus}->{args.to_gpus} GPUs)")
    for col in ("measure", "median", "min", "max"):
        table.add_column(col)
    for key, values in result["samples"].items():
        table.add_row(key, f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}")
    console.print(table)
    console.print(f"written to {args.out}")
    return 0


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
