"""What ``make demo-distributed`` observes and reports: the task instances in Airflow's metadata
database over time (workers, triggerers), the triggerer it killed, and per training its figures
joined with the broker's (:mod:`airflow_elastic_gpu.demo_distributed` runs the deployment)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text
from sqlalchemy import text
from sqlalchemy.engine import Engine

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.demo import gpu_history

DAG_ID = "elastic_gpu_distributed"
TASK_ID = "train"
POOL = "default"


@dataclass
class Observer:
    """What the metadata database shows of the trainings over time, sampled once a second:
    per map index, the workers that ran it and the triggerers that held its trigger (with the
    seconds since the run was triggered when each was first seen)."""

    engine: Engine
    run_id: str
    t0: float
    workers: dict[int, list[str]] = field(default_factory=dict)
    triggerers: dict[int, list[tuple[str, float]]] = field(default_factory=dict)
    states: dict[int, str] = field(default_factory=dict)
    holder: dict[int, str | None] = field(default_factory=dict)

    def sample(self) -> None:
        with self.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT ti.map_index, ti.state, ti.hostname, j.hostname FROM task_instance ti "
                "LEFT JOIN trigger t ON t.id = ti.trigger_id LEFT JOIN job j ON j.id = t.triggerer_id "
                "WHERE ti.dag_id = :d AND ti.run_id = :r AND ti.task_id = :t AND ti.map_index >= 0"),
                {"d": DAG_ID, "r": self.run_id, "t": TASK_ID}).all()
        now = time.monotonic() - self.t0
        for map_index, state, worker, triggerer in rows:
            self.states[map_index] = state or "none"
            seen = self.workers.setdefault(map_index, [])
            if worker and (not seen or seen[-1] != worker):
                seen.append(worker)
            self.holder[map_index] = triggerer if state == "deferred" else None
            held = self.triggerers.setdefault(map_index, [])
            if triggerer and state == "deferred" and (not held or held[-1][0] != triggerer):
                held.append((triggerer, round(now, 1)))

    def deferred_on(self) -> Counter[str]:
        """Deferred trainings per triggerer now."""
        return Counter(h for h in self.holder.values() if h)

    def run_state(self) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT state FROM dag_run WHERE dag_id = :d AND run_id = :r"),
                                {"d": DAG_ID, "r": self.run_id}).scalar()

    def view(self) -> Table:
        table = Table(title="trainings in Airflow")
        for col in ("map index", "state", "workers", "triggerers"):
            table.add_column(col)
        for i in sorted(self.states):
            table.add_row(str(i), self.states[i], " -> ".join(self.workers.get(i, [])),
                          " -> ".join(f"{h} ({t:.0f}s)" for h, t in self.triggerers.get(i, [])))
        return table


@dataclass(frozen=True)
class TriggererKill:
    """The triggerer killed: who, when (seconds since the trigger of the DAG run), the trainings
    it held, and per training the seconds after the kill at which the survivor held it."""

    victim: str
    survivor: str
    at_s: float
    held: tuple[int, ...]
    taken_over_after_s: dict[int, float]


@dataclass(frozen=True)
class TrainingFigures:
    """One training's figures (seconds, GPU-seconds; workers and triggerers in the order seen)."""

    map_index: int
    name: str
    status: str
    jct_s: float | None
    queueing_delay_s: float | None
    gpu_seconds: float
    gpus_over_time: list[int]
    resizes_up: int
    resizes_down: int
    accuracy: float | None
    workers: list[str]
    triggerers: list[str]
    failed_tries: int = 0  # earlier tries of the task whose job ended without success (a retry replaced it)


def training_figures(broker: GpuBroker, obs: Observer) -> list[TrainingFigures]:
    """Per broker job of the run, its figures joined with what Airflow showed of its task."""
    out, jobs = [], broker.jobs(POOL)
    failed = Counter(j.key.split("@", 1)[0] for j in jobs if "@" in j.key and j.status.value != "succeeded")
    for j in jobs:
        if "@" in j.key or j.key.count("/") < 3:  # a try's job a retry replaced (key@job id), or no task's
            continue
        dag_id, task_id, rest = j.key.split("/", 2)
        run_id, map_index = rest.rsplit("/", 1)
        if dag_id != DAG_ID or task_id != TASK_ID or run_id != obs.run_id:
            continue
        i = int(map_index)
        counts, _, up, down = gpu_history(broker, j.id)
        out.append(TrainingFigures(
            map_index=i, name=j.name, status=j.status.value,
            jct_s=None if j.jct_s is None else round(j.jct_s, 1),
            queueing_delay_s=None if j.queueing_delay_s is None else round(j.queueing_delay_s, 1),
            gpu_seconds=round(j.gpu_seconds, 1), gpus_over_time=counts, resizes_up=up, resizes_down=down,
            accuracy=(j.metrics or {}).get("accuracy"), workers=obs.workers.get(i, []),
            triggerers=[h for h, _ in obs.triggerers.get(i, [])], failed_tries=failed[j.key]))
    return sorted(out, key=lambda f: f.map_index)


def summary(figures: list[TrainingFigures], kill: TriggererKill | None, title: str) -> Table:
    table = Table(title=title)
    for col in ("task", "job", "status", "JCT s", "queued s", "GPU-s", "GPUs over time", "up", "down",
                "accuracy", "workers", "triggerers"):
        table.add_column(col, justify="right" if col.endswith(("s", "up", "down", "accuracy")) else "left")
    for f in figures:
        moved = kill is not None and f.map_index in kill.taken_over_after_s
        trig = " -> ".join(f.triggerers) + (f" ({kill.taken_over_after_s[f.map_index]:.0f}s after the kill)"
                                            if moved else "")
        table.add_row(
            Text(f"{TASK_ID}[{f.map_index}]"), Text(f.name), f.status, "-" if f.jct_s is None else f"{f.jct_s:.0f}",
            "-" if f.queueing_delay_s is None else f"{f.queueing_delay_s:.0f}", f"{f.gpu_seconds:.0f}",
            " -> ".join(map(str, f.gpus_over_time)) or "-", str(f.resizes_up), str(f.resizes_down),
            "-" if f.accuracy is None else f"{f.accuracy:.3f}", " -> ".join(f.workers), trig)
    return table
