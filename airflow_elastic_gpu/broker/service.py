"""GpuBroker: the shared state of all training jobs and every change to it, one transaction each.

The broker is split by responsibility, one module each:

* :mod:`.transactions`: engine, sessions, pool and job locks, retries, events;
* :mod:`.rebalance`: the adapter to the scheduling core (:mod:`airflow_elastic_gpu.scheduling.core`),
  coalesced rebalances;
* :mod:`.queries`: read queries (jobs, nodes, events, snapshots);
* :mod:`.lifecycle`: a job's life (submit, start, heartbeat, progress, ack, finish, fail, cancel);
* :mod:`.inventory`: pools, nodes, GPUs and pool settings.

No GPU is ever in use by two jobs: the two-phase resize protocol ensures it, and the primary key of
``gpu_in_use`` (and of ``gpu_target``) enforces it in the database.
"""

from __future__ import annotations

from airflow_elastic_gpu.broker.inventory import Inventory
from airflow_elastic_gpu.broker.types import (
    BrokerError,
    EventView,
    GpuView,
    InvalidRequest,
    JobSpec,
    JobView,
    NodeView,
    NotFound,
    PoolSnapshot,
    Target,
    compile_progress_pattern,
)

__all__ = [
    "BrokerError", "EventView", "GpuBroker", "GpuView", "InvalidRequest", "JobSpec", "JobView",
    "NodeView", "NotFound", "PoolSnapshot", "Target", "compile_progress_pattern",
]


class GpuBroker(Inventory):
    """The broker. Thread-safe: each call opens its own session and transaction.

    :param url_or_engine: broker database URL or an engine; default
        :func:`airflow_elastic_gpu.config.default_broker_url`. Clients of one URL in one process
        share one engine (connection pool).
    :param policy: a policy object that overrides every pool's configured one (the simulator and
        tests use this); default: each pool's own setting (:meth:`configure_pool`), which every
        process sharing the DB sees.
    :param clock: returns the time in seconds (epoch); injected for tests and the simulator; default:
        on PostgreSQL the database server's clock (:mod:`~airflow_elastic_gpu.broker.clock`), on
        SQLite the machine's.
    :param default_restart_overhead_s: assumed until a job's first resize is measured (seconds).
    :param migrate: bring the schema to the latest revision if a version check finds it behind.
    """
