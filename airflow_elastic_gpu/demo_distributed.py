"""``make demo-distributed``: Airflow as users deploy it, on one machine, with a triggerer killed mid-run.

PostgreSQL holds Airflow's metadata database and the broker's (two fresh databases,
``<prefix>_airflow`` and ``<prefix>_broker``, dropped and re-created at the start); CeleryExecutor
sends tasks through Redis to **two Celery workers**; **two triggerers** watch the deferred
trainings; a scheduler, a dag-processor and an API server complete the deployment. Each process
gets its own host name (``[core] hostname_callable``, as if it ran on its own machine). The DAG
``elastic_gpu_distributed`` maps real PyTorch trainings over both workers, all sharing one pool
of virtual GPUs.

While trainings are deferred and both triggerers hold some of them, the triggerer holding more
is killed (SIGKILL to its process group, as a machine dies). The survivor takes its triggers
over once the dead one's heartbeat is older than ``[triggerer] triggerer_health_check_threshold``
(set to a few seconds here; Airflow's default is 30 s), and every training must finish. The
broker's invariants (no GPU held twice, ...) are checked every few seconds and at the end.

The summary gives, per training, its JCT, queueing delay, GPU-seconds, GPU counts over time,
resizes, accuracy, the workers that ran it (``execute``, then ``execute_complete``) and the
triggerers that watched it; it is written as JSON to ``--results``. Every process the run
started is killed at the end, also on an error or Ctrl-C (:mod:`airflow_elastic_gpu.demo_processes`).

    python -m airflow_elastic_gpu.demo_distributed [--jobs 6] [--steps 300] [--step-ms 200]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from base64 import urlsafe_b64encode
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.cli_broker import first_line
from airflow_elastic_gpu.cli_views import snapshot_view
from airflow_elastic_gpu.config import ENV_BROKER_URL, ENV_WORK_DIR, mask_url
from airflow_elastic_gpu.demo import parse_run_id
from airflow_elastic_gpu.demo_distributed_report import (
    DAG_ID,
    POOL,
    TASK_ID,
    Observer,
    TriggererKill,
    summary,
    training_figures,
)
from airflow_elastic_gpu.demo_processes import HOSTNAME_ENV, ProcessGroups, demo_hostname, free_port

REPO = Path(__file__).resolve().parents[1]
VIRTUAL_GPUS = 4
WORKERS = ("worker-1", "worker-2")
TRIGGERERS = ("triggerer-1", "triggerer-2")
console = Console(width=max(Console().width, 140))


@dataclass(frozen=True)
class Settings:
    """One run's settings.

    :param jobs: mapped trainings.
    :param steps: steps of the middle-sized training (the others do 2/3 and 4/3 of it).
    :param step_ms: milliseconds per step of the global batch on one GPU (``train_digits --step-ms``).
    :param home: directory of ``AIRFLOW_HOME`` (``airflow/``), the logs (``logs/``) and the jobs'
        directories (``jobs/``); those three are emptied at the start.
    :param postgres_url: a PostgreSQL server's URL (any database: it is used to create ours).
    :param db_prefix: our databases are ``<db_prefix>_airflow`` and ``<db_prefix>_broker``.
    :param celery_broker: Celery's broker URL (Redis or RabbitMQ).
    :param heartbeat_s: ``[triggerer] job_heartbeat_sec``, seconds.
    :param triggerer_threshold_s: ``[triggerer] triggerer_health_check_threshold``, seconds.
    :param timeout_s: the DAG run must end within this many seconds of being triggered.
    :param results: JSON file of the figures.
    :param drop_databases: drop our databases at the end.
    """

    jobs: int = 6
    steps: int = 300
    step_ms: float = 200.0
    home: Path = REPO / ".demo-distributed"
    postgres_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    db_prefix: str = "elastic_demo"
    celery_broker: str = "redis://127.0.0.1:6379/0"
    heartbeat_s: float = 1.0
    triggerer_threshold_s: float = 10.0
    timeout_s: float = 900.0
    results: Path = REPO / "benchmarks" / "results" / "distributed.json"
    drop_databases: bool = False

    def db_url(self, what: str) -> str:
        """URL of our database ``what`` (``airflow`` or ``broker``) on the server."""
        return make_url(self.postgres_url).set(database=f"{self.db_prefix}_{what}").render_as_string(
            hide_password=False)

    @property
    def triggerer_capacity(self) -> int:
        """Triggers per triggerer: a bit over half the trainings, so that both triggerers hold some
        (each takes every unassigned trigger up to its capacity) and the survivor can take most of
        the dead one's at once."""
        return math.ceil(self.jobs / 2) + 1


HOME_MARKER = ".elastic-gpu-demo-home"
"""The file a run leaves in its ``--home``: the next run may delete what it made there."""
STALE = ("airflow", "logs", "jobs")
"""What a run makes in its ``--home`` (Airflow's home, the processes' logs, the job directories),
deleted by the next run."""


def recreate_databases(s: Settings, drop_only: bool = False) -> None:
    """Drop ``<prefix>_airflow`` and ``<prefix>_broker`` (closing their sessions), then create them.

    :raises sqlalchemy.exc.OperationalError: the server is unreachable.
    """
    admin = create_engine(s.postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for what in ("airflow", "broker"):
                name = f"{s.db_prefix}_{what}"
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = :n AND pid <> pg_backend_pid()"), {"n": name})
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
                if not drop_only:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()


def airflow_env(s: Settings, api_port: int, queue: str) -> dict[str, str]:
    """The environment every Airflow process of the run shares."""
    home = s.home / "airflow"
    airflow_db = s.db_url("airflow")
    return {
        # none of the caller's Airflow settings (its connection elastic_gpu_default, config file,
        # secrets backend, retries): the demo's trainings would go to the caller's broker
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k not in (ENV_BROKER_URL, ENV_WORK_DIR)},
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CORE__PARALLELISM": "32",
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{demo_hostname.__module__}.demo_hostname",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__FERNET_KEY": urlsafe_b64encode(secrets.token_bytes(32)).decode(),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://localhost:{api_port}/execution/",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{api_port}",
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db,
        # psycopg 3 is sync and async; Airflow would otherwise want asyncpg for its async engine
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": airflow_db,
        "AIRFLOW__CELERY__BROKER_URL": s.celery_broker,
        "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{airflow_db}",
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
        "AIRFLOW__OPERATORS__DEFAULT_QUEUE": queue,  # a queue of this run's own on a shared broker
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": str(s.heartbeat_s),
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(s.triggerer_threshold_s),
        "AIRFLOW__ELASTIC_GPU__BROKER_URL": s.db_url("broker"),
        "AIRFLOW__ELASTIC_GPU__WORK_DIR": str(s.home / "jobs"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }


def airflow_bin() -> str:
    return str(Path(sys.executable).with_name("airflow"))


def start_deployment(procs: ProcessGroups, s: Settings, env: dict[str, str], queue: str) -> None:
    """API server, scheduler, dag-processor, two Celery workers, two triggerers, each in its own
    process group; the workers and triggerers with their own host name and log-server port."""
    af = airflow_bin()
    procs.start("api-server", [af, "api-server", "--port", env["AIRFLOW__API__PORT"]], env)
    procs.start("scheduler", [af, "scheduler"], env)
    procs.start("dag-processor", [af, "dag-processor"], env)
    for name in WORKERS:
        procs.start(name, [af, "celery", "worker", "--celery-hostname", f"{name}@%h", "--queues", queue,
                           "--concurrency", "2"],
                    {**env, HOSTNAME_ENV: name, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())})
    for name in TRIGGERERS:
        procs.start(name, [af, "triggerer", "--capacity", str(s.triggerer_capacity)],
                    {**env, HOSTNAME_ENV: name, "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port())})


def wait_until(what: str, ready, timeout_s: float, procs: ProcessGroups, poll_s: float = 2.0) -> None:
    """Wait until ``ready()`` is true.

    :raises SystemExit: it is not within ``timeout_s`` seconds, or a process of the run died.
    """
    deadline = time.monotonic() + timeout_s
    while not ready():
        dead = [n for n in procs.procs if not procs.alive(n)]
        if dead:
            raise SystemExit(f"{', '.join(dead)} exited while waiting for {what}; see {procs.log_dir}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen in {timeout_s:.0f}s; see {procs.log_dir}")
        time.sleep(poll_s)


def api_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{port}/api/v2/monitor/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def invariant_checker():
    """``check(engine, pool)`` of ``benchmarks/broker_load.py``: invariant violations by name."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.broker_load import check

    return check


def run(s: Settings) -> dict:
    """Run the distributed demo with settings ``s`` and return its figures (also written to
    ``s.results``). All processes are killed before it returns or raises.

    :raises SystemExit: a step did not happen in time, or a process of the deployment died.
    """
    check = invariant_checker()
    marker = s.home / HOME_MARKER
    if s.home.exists() and not s.home.is_dir():
        raise SystemExit(f"--home {s.home} is a file, not a directory")
    own = s.home.resolve() == Settings().home.resolve()  # the checkout's .demo-distributed: the demo's own
    if not own and not marker.exists() and any((s.home / stale).exists() for stale in STALE):
        raise SystemExit(f"--home {s.home} holds {', '.join(x for x in STALE if (s.home / x).exists())} that this "
                         f"demo did not make (no {HOME_MARKER} there): a run deletes them; give an empty or new "
                         "directory")
    t_setup = time.monotonic()
    console.print(f"[bold]1/5[/bold] databases {s.db_prefix}_airflow and {s.db_prefix}_broker (re-created)")
    try:  # the server answers: a run that fails here deletes nothing
        recreate_databases(s)
    except DBAPIError as exc:  # unreachable, or a role that may not create databases: one line
        raise SystemExit(f"cannot make the demo's databases on {mask_url(s.postgres_url)}: {first_line(exc)} (give "
                         "--postgres-url, a server and a role that may create databases)") from None
    for stale in STALE:  # a previous run's Airflow home, logs and job directories
        shutil.rmtree(s.home / stale, ignore_errors=True)
    s.home.mkdir(parents=True, exist_ok=True)
    marker.write_text("made by airflow_elastic_gpu.demo_distributed: its airflow, logs and jobs are deleted at each run\n")
    broker = GpuBroker(s.db_url("broker"))
    broker.register_node("localhost", VIRTUAL_GPUS, gpu_type="virtual")
    broker.configure_pool(policy_params={"hysteresis": 1.0, "min_resize_interval_s": 10.0},
                          lease_s=60, rebalance_interval_s=5)
    api_port = free_port()
    queue = f"{s.db_prefix}_{os.getpid()}"
    env = airflow_env(s, api_port, queue)
    airflow_engine = create_engine(s.db_url("airflow"), pool_size=1, max_overflow=1)
    procs = ProcessGroups(s.home / "logs")
    try:
        with procs:
            migrate = subprocess.run([airflow_bin(), "db", "migrate"], check=False, env=procs.env(env), capture_output=True,
                                     text=True, timeout=600)
            if migrate.returncode != 0:
                raise SystemExit(f"airflow db migrate failed: {migrate.stderr[-3000:]}")
            console.print("[bold]2/5[/bold] starting api-server, scheduler, dag-processor, "
                          f"{' and '.join(WORKERS)} (Celery, queue {queue}), {' and '.join(TRIGGERERS)} "
                          f"(capacity {s.triggerer_capacity}); logs in {procs.log_dir}")
            start_deployment(procs, s, env, queue)
            wait_until("the API server's health", lambda: api_healthy(api_port), 300, procs)

            def parsed() -> bool:
                with airflow_engine.connect() as conn:
                    return conn.execute(text("SELECT count(*) FROM serialized_dag WHERE dag_id = :d"),
                                        {"d": DAG_ID}).scalar() > 0
            wait_until(f"the parsing of {DAG_ID}", parsed, 300, procs)
            # only this DAG runs (the folder's other DAGs stay paused, as new DAGs are by default)
            out = subprocess.run([airflow_bin(), "dags", "unpause", DAG_ID], check=False, env=procs.env(env),
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise SystemExit(f"could not unpause {DAG_ID}: {out.stderr[-2000:]}")
            conf = {"jobs": s.jobs, "steps": s.steps, "step_ms": s.step_ms}
            out = subprocess.run([airflow_bin(), "dags", "trigger", DAG_ID, "--conf", json.dumps(conf), "-o", "json"],
                                 check=False, env=procs.env(env), capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise SystemExit(f"could not trigger {DAG_ID}: {out.stderr[-2000:]}")
            run_id = parse_run_id(out.stdout)
            setup_s = time.monotonic() - t_setup
            console.print(f"[bold]3/5[/bold] triggered {run_id} ({s.jobs} trainings on {VIRTUAL_GPUS} "
                          f"virtual GPUs) after {setup_s:.0f}s of set-up")
            t0 = time.monotonic()
            obs = Observer(airflow_engine, run_id, t0)
            kill: TriggererKill | None = None
            violations: Counter[str] = Counter()
            checks = 0
            state = None
            last_check = 0.0
            with Live(console=console, refresh_per_second=1) as live:
                while state not in ("success", "failed"):
                    if time.monotonic() - t0 > s.timeout_s:
                        state = "timed out"
                        break
                    time.sleep(1)
                    obs.sample()
                    held = obs.deferred_on()
                    if kill is None and all(held[t] > 0 for t in TRIGGERERS):
                        victim = max(TRIGGERERS, key=lambda t: (held[t], t == TRIGGERERS[0]))
                        survivor = next(t for t in TRIGGERERS if t != victim)
                        procs.kill(victim)
                        at = time.monotonic() - t0
                        kill = TriggererKill(victim, survivor, round(at, 1),
                                             tuple(sorted(i for i, h in obs.holder.items() if h == victim)), {})
                        console.print(f"killed {victim} (SIGKILL to its process group) {at:.0f}s into the run, "
                                      f"holding trainings {list(kill.held)}; {survivor} holds {held[survivor]}")
                    if kill is not None:
                        for i in kill.held:
                            hosts = obs.triggerers.get(i, [])
                            if i not in kill.taken_over_after_s and hosts and hosts[-1][0] == kill.survivor:
                                kill.taken_over_after_s[i] = round(hosts[-1][1] - kill.at_s, 1)
                    if time.monotonic() - last_check > 3:
                        last_check = time.monotonic()
                        violations.update(check(broker.engine, POOL))
                        checks += 1
                        state = obs.run_state()
                    dead = [n for n in procs.procs if not procs.alive(n) and (kill is None or n != kill.victim)]
                    if dead:
                        raise SystemExit(f"{', '.join(dead)} died during the run; see {procs.log_dir}")
                    live.update(Group(snapshot_view(broker.snapshot(POOL)), obs.view()))
            wall_s = time.monotonic() - t0
            obs.sample()
            violations.update(check(broker.engine, POOL))
            checks += 1
            figures = training_figures(broker, obs)
            jobs = [j for j in broker.jobs(POOL) if j.key.startswith(f"{DAG_ID}/{TASK_ID}/{run_id}/")]
            makespan = (max(j.end_s for j in jobs) - min(j.submit_s for j in jobs)
                        if jobs and all(j.end_s for j in jobs) else None)
    finally:
        airflow_engine.dispose()
        if s.drop_databases:
            broker.engine.dispose()
            recreate_databases(s, drop_only=True)
    if not console.is_terminal:  # Live left its last frame without a line end
        console.print()
    console.print("[bold]4/5[/bold] summary (every process of the deployment stopped)")
    ends = [f for f in figures if f.jct_s is not None]
    console.print(summary(figures, kill, f"{DAG_ID} run {run_id}: {state}"))
    result = {
        "command": "python -m airflow_elastic_gpu.demo_distributed " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("jobs", s.jobs), ("steps", s.steps), ("step_ms", s.step_ms))),
        "deployment": {"metadata_db": "postgresql", "broker_db": "postgresql", "executor": "CeleryExecutor",
                       "celery_broker": make_url(s.celery_broker).drivername, "workers": list(WORKERS),
                       "triggerers": list(TRIGGERERS), "triggerer_capacity": s.triggerer_capacity,
                       "triggerer_job_heartbeat_sec": s.heartbeat_s,
                       "triggerer_health_check_threshold_s": s.triggerer_threshold_s, "virtual_gpus": VIRTUAL_GPUS},
        "dag_run_state": state,
        "setup_s": round(setup_s, 1),
        "wall_s": round(wall_s, 1),
        "makespan_s": None if makespan is None else round(makespan, 1),
        "mean_jct_s": round(sum(f.jct_s for f in ends) / len(ends), 1) if ends else None,
        "trainings_succeeded": sum(f.status == "succeeded" for f in figures),
        "failed_tries": sum(f.failed_tries for f in figures),
        "trainings": [asdict(f) for f in figures],
        "trainings_started_per_worker": dict(Counter(f.workers[0] for f in figures if f.workers)),
        "trainings_completed_per_worker": dict(Counter(f.workers[-1] for f in figures if f.workers)),
        "killed_triggerer": None if kill is None else asdict(kill),
        "invariant_checks": checks,
        "invariant_violations": dict(violations),
    }
    s.results.parent.mkdir(parents=True, exist_ok=True)
    s.results.write_text(json.dumps(result, indent=2) + "\n")
    total = sum(violations.values())
    console.print(
        f"[bold]5/5[/bold] {result['trainings_succeeded']}/{s.jobs} trainings succeeded"
        + (f" ({result['failed_tries']} after a failed try)" if result["failed_tries"] else "") + "; "
        f"started per worker {result['trainings_started_per_worker']}, completed per worker "
        f"{result['trainings_completed_per_worker']}; "
        + ("no triggerer was killed" if kill is None else
           f"{kill.victim} killed at {kill.at_s:.0f}s holding {len(kill.held)}, {kill.survivor} took over "
           f"{len(kill.taken_over_after_s)} after {', '.join(f'{v:.0f}' for v in kill.taken_over_after_s.values())}s")
        + f"; broker invariant: {total} violations in {checks} checks; wall {wall_s:.0f}s"
        + ("" if makespan is None else f", makespan {makespan:.0f}s") + f"; figures in {s.results}")
    return result


def main(argv: list[str] | None = None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=d.jobs, help="mapped trainings (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps of the middle-sized training")
    p.add_argument("--step-ms", type=float, default=d.step_ms, help="milliseconds per step on one GPU")
    p.add_argument("--home", type=Path, default=d.home,
                   help="where AIRFLOW_HOME, logs and job directories are made (deleted and made again at each run; "
                        "a directory holding them that a run did not make is refused)")
    p.add_argument("--postgres-url", default=d.postgres_url, help="a PostgreSQL server (to create our databases)")
    p.add_argument("--db-prefix", default=d.db_prefix, help="our databases: PREFIX_airflow, PREFIX_broker")
    p.add_argument("--celery-broker", default=d.celery_broker, help="Redis or RabbitMQ URL for Celery")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="seconds the DAG run may take")
    p.add_argument("--results", type=Path, default=d.results, help="JSON file of the figures")
    p.add_argument("--drop-databases", action="store_true", help="drop our databases at the end")
    a = p.parse_args(argv)
    if a.jobs < 2:
        p.error("--jobs must be >= 2 (each triggerer must hold a training before one is killed)")
    s = Settings(jobs=a.jobs, steps=a.steps, step_ms=a.step_ms, home=a.home.resolve(), postgres_url=a.postgres_url,
                 db_prefix=a.db_prefix, celery_broker=a.celery_broker, timeout_s=a.timeout_s,
                 results=a.results.resolve(), drop_databases=a.drop_databases)
    # SIGTERM (and SIGHUP) unwind like Ctrl-C does, through the cleanup of every process
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    result = run(s)
    ok = (result["dag_run_state"] == "success" and result["trainings_succeeded"] == s.jobs
          and not sum(result["invariant_violations"].values()) and result["killed_triggerer"] is not None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
