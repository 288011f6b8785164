"""Benchmark: many concurrent clients against one broker pool on PostgreSQL, with an invariant checker.

``--clients`` clients (default 64, threads spread over ``--processes`` processes, default 4, as
agents and triggerers are separate processes), each with its own ``GpuBroker`` (own connection
pool), issue a randomized
mix of submit / progress / heartbeat / ack / finish / fail / cancel /
rebalance against one pool until ``--ops`` operations (default 10,000) are
done. An independent checker thread reads the load's pool throughout (every 0.1 s, and
once at the end) and counts invariant violations:

* a GPU in two jobs' in-use sets, or two jobs' target sets, or in one job's in-use set and
  another's target;
* more GPUs in use than the pool has;
* an ended job that still holds or targets a GPU;
* a running job (acked) whose in-use set is below its ``min_gpus``;
* a job whose target or in-use set names a GPU of another pool.

Writes ``benchmarks/results/broker_load.json`` (ops/s, p50/p99 latency per
operation, violations, retried transactions).

    python benchmarks/broker_load.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test]
                                     [--clients 64] [--ops 10000] [--seed 0] [--processes 4]
    python benchmarks/broker_load.py --restart-server --clients 16   # a private server, restarted mid-run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.util import LRUCache

from airflow_elastic_gpu.broker.db import create_broker_engine, migrate
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import BrokerError, JobSpec
from airflow_elastic_gpu.config import mask_url
from airflow_elastic_gpu.simulator.results import nearest_rank

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "broker_load.json"
RESTART_RESULTS = REPO / "benchmarks" / "results" / "broker_load_restart.json"
DEFAULT_URL = os.environ.get("ELASTIC_GPU_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
OPS = ("submit", "progress", "heartbeat", "ack", "finish", "fail", "cancel", "rebalance")
WEIGHTS = (10, 30, 20, 20, 6, 2, 2, 10)

# Each check reads the load's pool only (the tables may hold other pools' rows), starting from the
# small sets (GPUs held, running jobs) so that one check costs a few milliseconds of server time.
_HELD = "SELECT h.gpu_id, h.job_id FROM {table} h JOIN job j ON j.id = h.job_id WHERE j.pool = :pool"
CHECKS = {
    "gpu in two jobs' in-use sets": (
        f"SELECT count(*) FROM (SELECT gpu_id FROM ({_HELD.format(table='gpu_in_use')}) x "
        "GROUP BY gpu_id HAVING count(*) > 1) y"),
    "gpu in two jobs' targets": (
        f"SELECT count(*) FROM (SELECT gpu_id FROM ({_HELD.format(table='gpu_target')}) x "
        "GROUP BY gpu_id HAVING count(*) > 1) y"),
    # the invariant the two-phase protocol keeps (the primary keys cannot): a GPU another job still
    # runs on is never published to a job
    "gpu in one job's in-use set and another's target": (
        "SELECT count(*) FROM gpu_in_use u JOIN gpu_target t ON t.gpu_id = u.gpu_id AND t.job_id <> u.job_id "
        "JOIN job j ON j.id = u.job_id WHERE j.pool = :pool"),
    "more GPUs in use than the pool has": (
        f"SELECT count(*) FROM ({_HELD.format(table='gpu_in_use')}) x HAVING count(*) > "
        "(SELECT count(*) FROM gpu g JOIN node n ON n.id = g.node_id WHERE n.pool = :pool)"),
    "ended job holds a GPU": (
        "SELECT count(*) FROM (SELECT job_id FROM gpu_in_use UNION ALL SELECT job_id FROM gpu_target) h "
        "JOIN job j ON j.id = h.job_id "
        "WHERE j.pool = :pool AND j.status IN ('succeeded','failed','lost')"),
    # a cancelled job holds its GPUs until its trainer stopped (its agent's report), or a lease
    # without heartbeat (freed by the next rebalance after it)
    "cancelled job holds a GPU past its lease": (
        "SELECT count(*) FROM (SELECT job_id FROM gpu_in_use UNION ALL SELECT job_id FROM gpu_target) h "
        "JOIN job j ON j.id = h.job_id JOIN gpu_pool p ON p.name = j.pool "
        "WHERE j.pool = :pool AND j.status = 'cancelled' "
        "AND :now - j.last_heartbeat_s > p.lease_s + p.rebalance_interval_s + 5"),
    "running job below its minimum": (
        "SELECT count(*) FROM job j WHERE j.pool = :pool AND j.status = 'running' AND j.acked_generation >= 1 AND "
        "(SELECT count(*) FROM gpu_in_use u WHERE u.job_id = j.id) < j.min_gpus"),
    "gpu of another pool": (
        f"SELECT count(*) FROM ({_HELD.format(table='gpu_in_use')} UNION ALL {_HELD.format(table='gpu_target')}) h "
        "JOIN gpu g ON g.id = h.gpu_id JOIN node n ON n.id = g.node_id WHERE n.pool <> :pool"),
}


def check(engine, pool: str) -> dict[str, int]:
    """Invariant violations found now in ``pool``, by name (one consistent snapshot)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        now = time.time()
        return {name: int(conn.execute(text(sql), {"pool": pool, "now": now}).scalar() or 0)
                for name, sql in CHECKS.items()}


def _client(n: int, url: str, pool: str, seed: int, remaining: Any, results: Any, compiled: Any) -> None:
    """One client: its own broker (own connection pool), a random mix of calls until the shared
    operation budget ``remaining`` is spent; its latencies go to ``results``. ``compiled``: the
    process's SQLAlchemy compiled-statement cache, shared by its clients."""
    rng = random.Random(seed * 1000 + n)
    # its own connection pool, as a separate process has; compiled statements shared in the process
    # (a long-running agent or API server compiles each statement once, not once per 150 calls)
    engine = create_broker_engine(url)
    broker = GpuBroker(engine.execution_options(compiled_cache=compiled), migrate=False)
    mine: list[str] = []
    latencies: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, int] = defaultdict(int)

    def take() -> bool:
        with remaining.get_lock():
            if remaining.value <= 0:
                return False
            remaining.value -= 1
            return True

    failure: str | None = None
    while failure is None and take():
        op = rng.choices(OPS, WEIGHTS)[0]
        if op != "submit" and op != "rebalance" and not mine:
            op = "submit"
        t0 = time.perf_counter()
        try:
            if op == "submit":
                lo = rng.randint(1, 4)
                job = broker.submit(JobSpec(f"load-{n}-{len(mine)}", "train", lo, rng.randint(lo, 12),
                                            total_steps=10_000, pool=pool, backend="simulated"))
                mine.append(job.id)
            elif op == "rebalance":
                broker.rebalance(pool)
            else:
                job_id = rng.choice(mine)
                if op == "progress":
                    broker.progress(job_id, rng.uniform(0, 10_000))
                elif op == "heartbeat":
                    broker.heartbeat(job_id)
                elif op == "ack":
                    target = broker.target(job_id)
                    broker.ack(job_id, target.generation)
                elif op == "finish":
                    broker.finish(job_id)
                    mine.remove(job_id)
                elif op == "fail":
                    broker.fail(job_id, "load test failure")
                    mine.remove(job_id)
                elif op == "cancel":  # and, as the job's agent would once the trainer stopped, its report
                    broker.cancel(job_id, "load test cancel")
                    broker.fail(job_id, "the trainer stopped")
                    mine.remove(job_id)
        except BrokerError as exc:  # e.g. a job too large for the pool: counted, not fatal
            errors[f"{op}: {type(exc).__name__}"] += 1
        except Exception as exc:  # noqa: BLE001 - a client that dies is reported, not hidden
            failure = f"client {n}, {op}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        latencies[op].append(time.perf_counter() - t0)
    engine.dispose()
    results.put((dict(latencies), dict(errors), broker.retries, broker.rebalances, failure))


def _process(first: int, count: int, url: str, pool: str, seed: int, remaining: Any, results: Any,
             ready: Any) -> None:
    """A client process: ``count`` client threads (numbers ``first`` ...), started once every process
    has imported what it needs (``ready``), so start-up is not timed."""
    compiled = LRUCache(1000)
    threads = [threading.Thread(target=_client, args=(first + i, url, pool, seed, remaining, results, compiled))
               for i in range(count)]
    ready.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_load(url: str, clients: int = 64, ops: int = 10_000, seed: int = 0, pool: str = "load",
             nodes: int = 4, gpus_per_node: int = 8, processes: int = 4,
             restart: Callable[[], float] | None = None, restart_after_s: float = 5.0,
             restart_after_ops: int | None = None) -> dict:
    """Run the load and return the figures (see the module docstring).

    :param processes: the clients are spread over this many processes (threads within each), as
        agents and triggerers are separate processes; 1 runs every client in this one.
    :param restart: restarts the database server (see ``private_postgres.PrivatePostgres.restart``),
        called once, ``restart_after_s`` seconds into the run or once ``restart_after_ops``
        operations (default half of them) are done, whichever comes first, so that it falls
        inside the run however fast the machine; every client must ride it out.
    """
    engine = create_broker_engine(url)
    migrate(engine)
    if engine.dialect.name == "postgresql":  # planner statistics current, as autovacuum keeps them
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
    setup = GpuBroker(engine, migrate=False)
    for i in range(nodes):
        setup.register_node(f"load-node-{i}", gpus_per_node, pool=pool)
    setup.configure_pool(pool, lease_s=3600, rebalance_interval_s=0.5)
    engine.dispose()
    processes = max(1, min(processes, clients))
    ctx = multiprocessing.get_context("spawn")
    remaining = ctx.Value("l", ops)
    results = ctx.Queue()
    violations: dict[str, int] = defaultdict(int)
    checks = [0]
    stop = threading.Event()

    def checker() -> None:
        while not stop.is_set():
            try:
                found = check(engine, pool)
            except OperationalError:  # the server dropped our connection too: check again
                time.sleep(0.05)
                continue
            for name, count in found.items():
                violations[name] += count
            checks[0] += 1
            time.sleep(0.1)

    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    starts = [sum(shares[:i]) for i in range(processes)]
    ready = ctx.Barrier(processes + 1)
    workers = [ctx.Process(target=_process,
                           args=(starts[i], shares[i], url, pool, seed, remaining, results, ready))
               for i in range(processes)]
    watch = threading.Thread(target=checker, name="checker")
    for w in workers:
        w.start()
    ready.wait()
    t0 = time.perf_counter()
    watch.start()
    restarts: list[dict[str, float]] = []

    after_ops = ops // 2 if restart_after_ops is None else restart_after_ops

    def restarter() -> None:
        while not stop.wait(0.01):
            if time.perf_counter() - t0 >= restart_after_s or ops - remaining.value >= after_ops:
                at_s, done = time.perf_counter() - t0, ops - remaining.value
                took = restart()
                restarts.append({"at_s": at_s, "after_ops": done, "took_s": took})
                return

    restart_thread = threading.Thread(target=restarter, name="restarter") if restart else None
    if restart_thread:
        restart_thread.start()
    latencies: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, int] = defaultdict(int)
    retries = rebalances = 0
    failures: list[str] = []
    for _ in range(clients):
        lat, err, redone, rebalanced, failure = results.get(timeout=3600)
        rebalances += rebalanced
        if failure:
            failures.append(failure)
        for op, values in lat.items():
            latencies[op].extend(values)
        for name, count in err.items():
            errors[name] += count
        retries += redone
    elapsed = time.perf_counter() - t0
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise RuntimeError(f"a client process exited with {w.exitcode}")
    stop.set()
    watch.join()
    if restart_thread:
        restart_thread.join()
    for attempt in range(50):  # the server may have dropped this engine's pooled connections
        try:
            found = check(engine, pool)
            break
        except OperationalError:
            if attempt == 49:
                raise
            time.sleep(0.1)
    for name, count in found.items():
        violations[name] += count
    checks[0] += 1
    done = sum(len(v) for v in latencies.values())
    result = {
        "url": engine.url.render_as_string(hide_password=True),
        "clients": clients,
        "processes": processes,
        "operations": done,
        "elapsed_s": elapsed,
        "ops_per_s": done / elapsed,
        "latency_ms": {
            op: {"count": len(v), "p50": 1000 * statistics.median(v),
                 "p99": 1000 * nearest_rank(v, 0.99)}
            for op, v in sorted(latencies.items())
        },
        "invariant_checks": checks[0],
        "invariant_violations": sum(violations.values()),
        "violations_by_kind": dict(violations),
        "retried_transactions": retries,
        "rebalances": rebalances,
        "client_failures": failures,
        "server_restarts": restarts,
        "rejected_requests": dict(errors),
    }
    engine.dispose()
    return result


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=DEFAULT_URL, help="PostgreSQL URL (a scratch database: the test adds pool 'load')")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=4,
                    help="client processes the clients are spread over (threads in each)")
    ap.add_argument("--restart-server", action="store_true",
                    help="run against a private PostgreSQL server (initdb/pg_ctl in a temporary directory, "
                         "not --url) and restart it (pg_ctl restart -m fast) during the run")
    ap.add_argument("--restart-after-s", type=float, default=5.0,
                    help="with --restart-server: restart this many seconds into the run, or once half the "
                         "operations are done if that comes first")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"results file (default {RESULTS.name}, or {RESTART_RESULTS.name} with --restart-server)")
    args = ap.parse_args()
    console = Console()
    out = args.out or (RESTART_RESULTS if args.restart_server else RESULTS)
    pool = f"load-{int(time.time())}"
    if args.restart_server:
        from private_postgres import PrivatePostgres

        with PrivatePostgres() as pg, console.status(
                f"{args.clients} clients, {args.ops} operations, server restarted after {args.restart_after_s:g}s"):
            result = run_load(pg.url, args.clients, args.ops, args.seed, pool=pool, processes=args.processes,
                              restart=pg.restart, restart_after_s=args.restart_after_s)
    else:
        with console.status(f"{args.clients} clients, {args.ops} operations against {mask_url(args.url)} ..."):
            result = run_load(args.url, args.clients, args.ops, args.seed, pool=pool, processes=args.processes)
    table = Table(title=f"{result['operations']} operations, {result['clients']} clients "
                        f"in {result['processes']} processes: "
                        f"{result['ops_per_s']:.0f} ops/s, {result['invariant_violations']} invariant violations "
                        f"in {result['invariant_checks']} checks, {result['retried_transactions']} retried transactions")
    for col in ("operation", "count", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for op, lat in result["latency_ms"].items():
        table.add_row(op, str(lat["count"]), f"{lat['p50']:.1f}", f"{lat['p99']:.1f}")
    console.print(table)
    for r in result["server_restarts"]:
        console.print(f"server restarted {r['at_s']:.1f}s into the run (took {r['took_s']:.2f}s)")
    for failure in result["client_failures"]:
        console.print(f"[red]client failed: {failure}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"written to {out}")
    return 1 if result["invariant_violations"] or result["client_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
