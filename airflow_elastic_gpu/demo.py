"""``make demo``: start Airflow (SQLite, LocalExecutor), run the demo DAG, show live progress and a summary.

Everything lives under ``.demo/`` in the repository: ``AIRFLOW_HOME`` (``.demo/airflow``, which
holds the broker's SQLite file and the jobs' directories at their default places, see
:mod:`airflow_elastic_gpu.config`) and ``standalone.log``. Airflow keeps running afterwards so the
UI can be browsed; ``make demo-stop`` stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text
from sqlalchemy.engine import make_url

from airflow_elastic_gpu.broker.history import applied_resizes
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.cli_views import UNWRAPPED_WIDTH, metric_text, snapshot_view
from airflow_elastic_gpu.config import default_broker_url, mask_url
from airflow_elastic_gpu.demo_processes import MARKER, kill_marked
from airflow_elastic_gpu.states import EventKind

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / ".demo"
PID_FILE = DEMO / "standalone.pid"
DAG_ID = "elastic_gpu_demo"
PORT_GIVEN = os.environ.get("ELASTIC_GPU_DEMO_PORT", "8080")
try:
    PORT = int(PORT_GIVEN)  # spaces around it are int()'s to drop
except ValueError:
    PORT = 0
PORT = PORT if 1 <= PORT <= 65535 else 0
"""Airflow's port (``$ELASTIC_GPU_DEMO_PORT``, default 8080); 0 for a value that is no TCP port
(said by :func:`main`: a traceback at import before)."""
VIRTUAL_GPUS = 4
RUN_MARK = f"make-demo:{DEMO.resolve()}"
"""The demo's :data:`~airflow_elastic_gpu.demo_processes.MARKER` value (one per checkout)."""
TIMEOUT_S = 900
# at least 120 columns on a terminal (the summary table), full width in a file or a pipe
console = Console(width=max(Console().width, 120) if Console().is_terminal else UNWRAPPED_WIDTH)


def demo_env() -> dict[str, str]:
    """This process's environment with ``AIRFLOW_HOME`` in ``.demo/`` and the broker URL and job
    directory at their defaults there (never a broker of the caller's)."""
    home = DEMO / "airflow"
    return {
        # none of the caller's Airflow settings: its config file, [elastic_gpu] broker_url, metadata
        # database or connections (elastic_gpu_default) would point the demo at the caller's broker
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "16",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__PORT": str(PORT),
        # the tasks call the execution API at the base URL (default port 8080, whatever the port)
        "AIRFLOW__API__BASE_URL": f"http://localhost:{PORT}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://localhost:{PORT}/execution/",
        # carried by every process of the demo, the jobs' agents, launchers and trainers too (in
        # sessions of their own): make demo-stop finds them by it
        MARKER: RUN_MARK,
        "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__TRIGGERER__CAPACITY": "100",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }


def gpu_history(broker: GpuBroker, job_id: str) -> tuple[list[int], int, int, int]:
    """A job's GPU counts over time (its first acked generation, then each resize the trainer ran),
    its resizes in all, up and down, from the broker's events. Resizes are counted at the ack
    (:func:`~airflow_elastic_gpu.broker.history.applied_resizes`), as the API and the GPU pool page
    count them; a move to as many GPUs elsewhere is neither up nor down."""
    events = broker.events(job_id=job_id)
    first_ack = next((e for e in events if e.kind == EventKind.ACK and e.data), None)
    resizes = applied_resizes(events)
    counts = ([int(first_ack.data["num_gpus"])] if first_ack else []) + [r.to_gpus for r in resizes]
    return counts, len(resizes), sum(r.grew for r in resizes), sum(r.shrank for r in resizes)


def summary_table(broker: GpuBroker, jobs, title: str) -> tuple[Table, int, int]:
    """Per job: status, JCT, queueing delay, GPU-seconds, its GPU counts over time, resizes (all, up,
    down), final accuracy; and the total resizes up and down.

    Resizes are those the trainer ran (:func:`~airflow_elastic_gpu.broker.history.applied_resizes`),
    so the count is the jobs table's, the API's and the GPU pool page's; a move to as many GPUs
    elsewhere is neither up nor down."""
    table = Table(title=title)
    for col in ("job", "status", "JCT s", "queued s", "GPU-s", "GPUs over time", "resizes", "up", "down",
                "accuracy"):
        table.add_column(col, justify="left" if col in ("job", "status", "GPUs over time") else "right")
    grew = shrank = 0
    for j in sorted(jobs, key=lambda j: j.name):
        counts, resized, up, down = gpu_history(broker, j.id)
        grew, shrank = grew + up, shrank + down
        acc = (j.metrics or {}).get("accuracy")
        table.add_row(
            Text(j.name), j.status.value, f"{j.jct_s:.0f}" if j.jct_s is not None else "-",
            f"{j.queueing_delay_s:.0f}" if j.queueing_delay_s is not None else "-",
            f"{j.gpu_seconds:.0f}", " -> ".join(map(str, counts)) or "-", str(resized), str(up), str(down),
            metric_text(acc),
        )
    return table, grew, shrank


def print_new_events(broker: GpuBroker, out: Console, after_id: int = 0) -> int:
    """Print one line per broker event after ``after_id`` (time, job, kind, message): the demo's view
    of the pool when its output is not a terminal. :returns: the id of the last event printed."""
    names = {j.id: j.name for j in broker.jobs()}
    for e in broker.events(after_id=after_id):
        stamp = time.strftime("%H:%M:%S", time.localtime(e.time_s))
        out.print(f"{stamp} {names.get(e.job_id or '', '-'):<12} {e.kind:<9} {e.message}", markup=False,
                  highlight=False, soft_wrap=True)
        after_id = e.id
    return after_id


def parse_run_id(stdout: str) -> str:
    """The run id from ``airflow dags trigger -o json`` output (log lines may come before the JSON)."""
    for line in stdout.splitlines():
        if line.lstrip().startswith("[{"):
            row = json.loads(line)[0]
            return row.get("dag_run_id") or row["run_id"]
    raise SystemExit(f"could not read the run id from `airflow dags trigger`: {stdout[-2000:]}")


def airflow(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("airflow")), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid`` (``psutil``: Linux, macOS; zombies left out)."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                out.append(proc.pid)
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to ask
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def stop() -> None:
    """Stop the demo's ``airflow standalone`` and everything it started: it runs in a session of its
    own, and some of its children (the scheduler's log server and executor workers) move to process
    groups of their own, so every process of the session is signalled, not only its group. The
    jobs' agents, launchers and trainers run in sessions of their own: every process that carries
    the demo's marker goes too (they trained on, and wrote to the broker database the next run
    deleted)."""
    _stop_airflow()
    if killed := kill_marked(RUN_MARK):
        console.print(f"stopped {killed} process(es) of the demo's trainings")


def _stop_airflow() -> None:
    if PID_FILE.exists():
        try:
            pid = int(PID_FILE.read_text())
        except ValueError:  # empty or cut (a full disk as it was written): no pid to stop
            PID_FILE.unlink(missing_ok=True)
            return
        if not any("airflow" in _cmdline(p) for p in session_members(pid)):
            PID_FILE.unlink(missing_ok=True)  # stale (a reboot, a crash): that pid is someone else's now
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for member in session_members(pid):
                try:
                    os.kill(member, sig)
                except ProcessLookupError:
                    pass
            for _ in range(30 if sig == signal.SIGTERM else 4):
                if not session_members(pid):
                    break
                time.sleep(0.5)
        PID_FILE.unlink(missing_ok=True)
        console.print("stopped the demo's Airflow")


def port_taken(port: int) -> bool:
    """Whether something listens on ``port`` of localhost."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_healthy(proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://localhost:{PORT}/api/v2/monitor/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"airflow standalone exited ({proc.returncode}); see {DEMO / 'standalone.log'}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"Airflow did not become healthy in {timeout_s:.0f}s; see {DEMO / 'standalone.log'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stop", action="store_true", help="stop the demo's Airflow and exit")
    args = parser.parse_args(argv)
    if not PORT and not args.stop:  # before anything is stopped
        raise SystemExit(f"ELASTIC_GPU_DEMO_PORT must be a TCP port from 1 to 65535, got {PORT_GIVEN!r}")
    stop()
    if args.stop:
        return 0
    env = demo_env()
    if port_taken(PORT):  # another Airflow there would pass the health check and get the tasks' calls
        raise SystemExit(f"port {PORT} is in use (another Airflow?): stop it, or choose another port with "
                         "ELASTIC_GPU_DEMO_PORT=8090 make demo")
    DEMO.mkdir(exist_ok=True)
    Path(env["AIRFLOW_HOME"]).mkdir(exist_ok=True)  # the broker's SQLite file goes there, before Airflow makes it
    url = default_broker_url(env)
    database = Path(make_url(url).database or "").resolve()
    if not database.is_relative_to(DEMO.resolve()):  # the demo starts afresh: never on another broker
        raise SystemExit(f"the demo's broker would be {mask_url(url)}, outside {DEMO}; not touching it")
    # afresh: the broker's database and Airflow's (an interrupted run's DAG run would go on there,
    # its tasks submitting to the new broker), each with its SQLite journal files
    for db in (database, Path(env["AIRFLOW_HOME"]) / "airflow.db"):
        for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), db.with_name(db.name + "-journal")):
            path.unlink(missing_ok=True)
    broker = GpuBroker(url)
    broker.register_node("localhost", VIRTUAL_GPUS, gpu_type="virtual")
    broker.configure_pool(policy_params={"hysteresis": 1.0, "min_resize_interval_s": 10.0},
                          lease_s=60, rebalance_interval_s=5)
    console.print(f"[bold]1/4[/bold] starting Airflow (scheduler, triggerer, dag-processor, api-server) "
                  f"in {env['AIRFLOW_HOME']}")
    log = open(DEMO / "standalone.log", "ab")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("airflow")), "standalone"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    PID_FILE.write_text(str(proc.pid))
    wait_healthy(proc)
    console.print("[bold]2/4[/bold] waiting for the demo DAG to be parsed")
    deadline = time.monotonic() + 180
    while airflow("dags", "unpause", DAG_ID, env=env).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"DAG {DAG_ID} was not parsed; see {DEMO / 'standalone.log'}")
        time.sleep(3)
    out = airflow("dags", "trigger", DAG_ID, "-o", "json", env=env)
    if out.returncode != 0:
        raise SystemExit(f"could not trigger {DAG_ID}: {out.stderr[-2000:]}")
    run_id = parse_run_id(out.stdout)
    console.print(f"[bold]3/4[/bold] triggered run {run_id}; the broker shares {VIRTUAL_GPUS} virtual GPUs")
    state = "running"
    deadline = time.monotonic() + TIMEOUT_S
    last_check = 0.0
    # a terminal gets the pool redrawn in place; a file or a pipe gets a line per event as it happens
    live = Live(snapshot_view(broker.snapshot()), console=console, refresh_per_second=1) \
        if console.is_terminal else contextlib.nullcontext()
    last_event = 0
    with live:
        while state not in ("success", "failed"):
            if time.monotonic() > deadline:
                state = "timed out"
                break
            if proc.poll() is not None:  # its metadata DB still says "running": it would wait out TIMEOUT_S
                state = f"Airflow exited with code {proc.returncode} (see {DEMO / 'standalone.log'})"
                break
            time.sleep(1)
            if isinstance(live, Live):
                live.update(snapshot_view(broker.snapshot()))
            else:
                last_event = print_new_events(broker, console, last_event)
            jobs = broker.jobs()
            # the run's state: soon once its trainings have ended, and every 30 s before (a task
            # that failed before submitting its job ends the run with fewer than 4 jobs)
            every_s = 5 if len(jobs) >= 4 and all(j.status.terminal for j in jobs) else 30
            if time.monotonic() - last_check > every_s:
                last_check = time.monotonic()
                res = airflow("dags", "state", DAG_ID, run_id, env=env)
                state = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else state
    jobs = broker.jobs()
    console.print("[bold]4/4[/bold] summary")
    table, grew, shrank = summary_table(broker, jobs, title=f"{DAG_ID} run {run_id}: {state}")
    console.print(table)
    # the project's virtual environment need not be activated: name its command
    cli = os.path.relpath(Path(sys.executable).parent / "airflow-elastic-gpu")
    console.print(f"resizes: {grew} up, {shrank} down; every decision and its reason: "
                  f"AIRFLOW_HOME={env['AIRFLOW_HOME']} {cli} status")
    console.print(f"Airflow UI: http://localhost:{PORT} (no login: every user is admin in this demo); "
                  "stop it with [bold]make demo-stop[/bold]")
    ok = state == "success" and all(j.status.value == "succeeded" for j in jobs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
