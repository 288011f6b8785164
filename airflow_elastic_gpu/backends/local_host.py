"""This host's GPUs for the local backend: finding them (``nvidia-smi``, else virtual ones), the
node name they are registered under, and the guards that keep them in one GPU pool of one broker."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from sqlalchemy.engine import make_url

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.config import default_host_claim_dir, default_virtual_gpus
from airflow_elastic_gpu.sidecar import protocol

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.broker.types import NodeView

LOCAL_NODE = "localhost"
"""The node name under which this host's GPUs are registered (``localhost-<i>`` for virtual nodes)."""
CLAIM_LOCK_TIMEOUT_S = 60.0
"""How long a broker waits for another's check, registration and claim of the host's GPUs (seconds)."""
CLAIM_FILE = "host-gpus.json"
"""The file in the host's claim directory (:func:`.config.default_host_claim_dir`) that names the
broker handing out this host's real GPUs (:func:`claim_host_gpus`)."""

@dataclass(frozen=True)
class HostGpus:
    """GPUs found on this host: device indices, product name, and whether they are virtual."""

    indices: tuple[int, ...]
    gpu_type: str
    virtual: bool


def detect_gpus(virtual_gpus: int | None = None, nvidia_smi: str = "nvidia-smi") -> HostGpus:
    """The host's NVIDIA GPUs via ``nvidia-smi``, else ``virtual_gpus`` virtual ones.

    Virtual GPUs only where there is no ``nvidia-smi`` or it finds no device: one that fails (a
    driver that does not answer, a time-out) is an error, not a host without GPUs (its pool would
    hand out virtual GPUs that are the real ones, and no other broker's claim would hold them).

    :param virtual_gpus: count of virtual GPUs when none is found (default
        ``[elastic_gpu] virtual_gpus``, ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS``, or 4); >= 1.
    :raises ValueError: ``nvidia-smi`` failed (its message), ``virtual_gpus`` < 1, or a configured
        value that is not an integer.
    """
    exe = shutil.which(nvidia_smi)
    if exe:
        try:
            run = subprocess.run([exe, "--query-gpu=index,name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False)
        except (subprocess.SubprocessError, OSError) as exc:
            raise ValueError(f"{exe} failed: {exc}; the host's GPUs cannot be listed") from None
        said = (run.stdout + run.stderr).strip()
        if run.returncode != 0 and "no devices were found" not in said.lower():
            raise ValueError(f"{exe} failed (exit {run.returncode}): {said[-500:] or 'no output'}; the host's "
                             "GPUs cannot be listed (take nvidia-smi off the PATH to use virtual GPUs)")
        rows = [line.split(",", 1) for line in run.stdout.strip().splitlines() if line.strip()]
        if run.returncode == 0 and rows:
            try:
                return HostGpus(tuple(int(i) for i, _ in rows), rows[0][1].strip(), False)
            except (ValueError, IndexError):
                raise ValueError(f"{exe} printed what is not a GPU list: {run.stdout[-500:]!r}") from None
    if virtual_gpus is None:
        virtual_gpus = default_virtual_gpus()
    if virtual_gpus < 1:
        raise ValueError(f"virtual_gpus must be >= 1, got {virtual_gpus}")
    return HostGpus(tuple(range(virtual_gpus)), "virtual", True)


_HOST_NODE = re.compile(rf"{re.escape(LOCAL_NODE)}(-\d+)?")


def is_host_node(name: str) -> bool:
    """Whether node ``name`` is this host's, as the local backend names it (:data:`LOCAL_NODE`, or
    ``LOCAL_NODE-<i>`` for its virtual nodes): its GPUs are this host's devices."""
    return _HOST_NODE.fullmatch(name) is not None


def check_host_not_in_another_pool(broker: GpuBroker, pool: str) -> None:
    """Refuse to register this host's GPUs (node :data:`LOCAL_NODE`, or ``LOCAL_NODE-<i>`` for
    virtual nodes) in ``pool`` when another pool has them: the same devices in two pools would be
    handed to a job of each.

    Checked before the registration, in its own read: two first runs naming two new pools at the
    same moment could both pass (a host's first registration is a set-up step, not a hot path).

    :raises BackendError: naming the pool that has them.
    """
    elsewhere = sorted({n.pool for n in broker.nodes() if _HOST_NODE.fullmatch(n.name) and n.pool != pool})
    if elsewhere:
        raise BackendError(
            f"this host's GPUs are already in pool {elsewhere[0]!r}: registering them in {pool!r} too "
            f"would hand the same GPUs to two jobs. Use pool {elsewhere[0]!r} (--pool, the operator's "
            f"pool=), or register other GPUs in {pool!r} (airflow-elastic-gpu nodes add NAME --gpus N)"
        )


def check_pool_of_this_host(work_dir: Path, broker: GpuBroker, pool: str) -> None:
    """Check an existing ``pool`` before a local job of it starts: the local backend runs every node
    of its pool on this host, so no two nodes may name the same device index (a node added by hand,
    ``nodes add n1 --gpus 2``, was given GPUs 0 and 1, which node ``localhost`` had too: two jobs
    trained on the same devices); and this host's real GPUs are this broker's (:func:`claim_host_gpus`).

    :raises BackendError: naming the nodes and the index they share, or :func:`claim_host_gpus`'s.
    """
    owner: dict[int, str] = {}
    for node in sorted(broker.nodes(pool), key=lambda n: n.name):
        for gpu in node.gpus:
            if (first := owner.setdefault(gpu.gpu.index, node.name)) != node.name:
                added = first if is_host_node(node.name) else node.name  # not this host's own node
                raise BackendError(
                    f"pool {pool!r} has nodes {first!r} and {node.name!r} with device index {gpu.gpu.index}: the "
                    "local backend runs every node of its pool on this host, so both would hand that GPU to a "
                    f"job. Remove one (airflow-elastic-gpu nodes remove {added} --pool {pool}) or give local "
                    "jobs a pool of their own (--pool, the operator's gpu_pool=)")
    claim_host_gpus(work_dir, broker, pool, registering=False)


def claim_host_gpus(work_dir: Path, broker: GpuBroker, pool: str, *, registering: bool) -> None:
    """Keep this host's real GPUs in one broker: the first broker found with them in ``pool`` is
    recorded in the host's claim, :data:`CLAIM_FILE` in :func:`.config.default_host_claim_dir`
    (one per host, whatever the ``$AIRFLOW_HOME``), and in ``work_dir`` (which containers on one
    host may share where each has a ``/var/tmp`` of its own); another broker that would register
    them, or has them, is refused.

    Two brokers would hand the same GPUs to a job each. That happens when a process reads another
    broker than the rest of the deployment: Airflow 3 reports a connection it could not read (a
    secrets backend or its API server away for a moment) as not defined, and the broker then falls
    back to the ``[elastic_gpu]`` section, whose default is a SQLite file in ``$AIRFLOW_HOME``; or
    when two Airflow installations share a host. A claim found in one place only (one recorded by a
    release that kept it in the work directory alone) is copied to the other. Virtual GPUs (CPU
    processes) are not claimed. Brokers are told apart by :func:`broker_identity`.

    :param registering: the caller registers the host's GPUs in ``pool`` next: only checked (the
        claim is recorded by the call after the registration, when the broker has them).
    :raises BackendError: another broker has them, naming both and the file; a malformed file, or
        a claim that cannot be recorded (:func:`claim_lock`).
    """
    paths = (default_host_claim_dir() / CLAIM_FILE, Path(work_dir) / CLAIM_FILE)
    name = broker_identity(broker.url)
    try:
        claims = [protocol.read_json(p) for p in paths]
        if all(c is not None and c.get("broker") == name for c in claims):
            return
        if registering and all(c is None for c in claims):
            return  # the first registration: recorded by the call after it
        if not registering and not any(_HOST_NODE.fullmatch(n.name) and any(g.gpu_type != "virtual" for g in n.gpus)
                                       for n in broker.nodes(pool)):
            return  # not this host's real GPUs (virtual ones, or nodes registered by hand)
        with claim_lock():
            claims = [protocol.read_json(p) for p in paths]
            first = next((c for c in claims if c is not None), None) or {"broker": name, "pool": pool}
            for path, claim in zip(paths, claims, strict=True):
                # this broker's claim where it is missing (a work directory not made yet: later)
                if claim is None and first.get("broker") == name and path.parent.is_dir():
                    protocol.write_json(path, first)
                    path.chmod(0o644)  # read by every user's processes on the host
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read or record which broker has this host's GPUs ({paths[0]}, {paths[1]}): "
                           f"{exc}") from None
    other = next(((p, c) for p, c in zip(paths, claims, strict=True)
                  if c is not None and c.get("broker") != name), None)
    if other is None:  # every claim this broker's (the first one, if none was recorded)
        return
    path, claim = other
    raise BackendError(
        f"this host's GPUs are handed out by the broker {claim.get('broker')!r} (recorded in {path}), not by this "
        f"process's broker {name!r}: two brokers would hand the same GPUs to two jobs. Every Airflow component "
        "and every Airflow installation on this host must read the same broker (the connection "
        "elastic_gpu_default, or [elastic_gpu] broker_url; Airflow reports a connection it cannot read for a "
        "moment as not defined, and the [elastic_gpu] section's broker is used then). If the broker moved for "
        f"good, delete {paths[0]} and {paths[1]} once no job of the old one runs")


@contextlib.contextmanager
def claim_lock(real: bool = True) -> Iterator[None]:
    """Hold the lock of the host's :data:`CLAIM_FILE` (re-entrant in its thread) across a broker's
    check, registration and claim of the host's GPUs; none for virtual GPUs (``real`` false).
    Makes the claim's directory (sticky and writable by all, as ``/tmp``: the host's users share it).

    :raises BackendError: the lock cannot be taken (held for a minute, a directory not writable)."""
    if not real:
        yield
        return
    directory = default_host_claim_dir()
    path = directory / f".{CLAIM_FILE}.lock"
    try:
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another user made it first
                directory.chmod(0o1777)
        lock = FileLock(path, timeout=CLAIM_LOCK_TIMEOUT_S, mode=0o666, is_singleton=True)
        lock.acquire()
    except OSError as exc:  # a Timeout too
        raise BackendError(f"cannot take {path}, which guards this host's GPUs: {exc} (set [elastic_gpu] "
                           "host_claim_dir to a directory every Airflow process on the host can write)") from None
    try:
        yield
    finally:
        lock.release()


def register_host_gpus(work_dir: Path, broker: GpuBroker, pool: str, found: HostGpus) -> NodeView:
    """Register ``found`` (this host's GPUs) as node :data:`LOCAL_NODE` of ``pool`` under the host's
    claim (:func:`claim_host_gpus`): the real ones only when no other broker has them, then claimed
    for ``broker``; one broker's check, registration and claim at a time (:func:`claim_lock`).

    :raises BackendError: another broker has them (naming both), or the claim file's lock cannot
        be taken."""
    with claim_lock(real=not found.virtual):
        if not found.virtual:  # no other broker has them (checked), then this one's claim (recorded)
            claim_host_gpus(work_dir, broker, pool, registering=True)
        view = broker.register_node(LOCAL_NODE, pool=pool, gpu_type=found.gpu_type, gpu_indices=found.indices)
        claim_host_gpus(work_dir, broker, pool, registering=False)
    return view


def broker_identity(url: str) -> str:
    """The broker database ``url`` names, as one string whatever the spelling: its dialect without
    the driver, user, host (lower case), port (the dialect's default if none) and database; no
    password, no query. A SQLite file by its absolute path. (Two host names of one server still
    read as two brokers.)"""
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        return f"sqlite:///{Path(u.database).resolve()}" if u.database and u.database != ":memory:" else "sqlite://"
    port = u.port or {"postgresql": 5432, "mysql": 3306}.get(backend)
    return f"{backend}://{u.username or ''}@{(u.host or 'localhost').lower()}:{port}/{u.database or ''}"
