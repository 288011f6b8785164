"""This host's GPUs for the local backend: finding them (``nvidia-smi``, else virtual ones), the
node name they are registered under, and the guard that keeps them in one GPU pool only."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.config import default_virtual_gpus

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker

LOCAL_NODE = "localhost"
"""The node name under which this host's GPUs are registered (``localhost-<i>`` for virtual nodes)."""

@dataclass(frozen=True)
class HostGpus:
    """GPUs found on this host: device indices, product name, and whether they are virtual."""

    indices: tuple[int, ...]
    gpu_type: str
    virtual: bool


def detect_gpus(virtual_gpus: int | None = None, nvidia_smi: str = "nvidia-smi") -> HostGpus:
    """The host's NVIDIA GPUs via ``nvidia-smi``, else ``virtual_gpus`` virtual ones.

    :param virtual_gpus: count of virtual GPUs when none is found (default
        ``[elastic_gpu] virtual_gpus``, ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS``, or 4); >= 1.
    :raises ValueError: ``virtual_gpus`` < 1, or a configured value that is not an integer.
    """
    exe = shutil.which(nvidia_smi)
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=index,name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout
            rows = [line.split(",", 1) for line in out.strip().splitlines() if line.strip()]
            if rows:
                return HostGpus(tuple(int(i) for i, _ in rows), rows[0][1].strip(), False)
        except (subprocess.SubprocessError, ValueError, OSError):
            pass
    if virtual_gpus is None:
        virtual_gpus = default_virtual_gpus()
    if virtual_gpus < 1:
        raise ValueError(f"virtual_gpus must be >= 1, got {virtual_gpus}")
    return HostGpus(tuple(range(virtual_gpus)), "virtual", True)


_HOST_NODE = re.compile(rf"{re.escape(LOCAL_NODE)}(-\d+)?")


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
