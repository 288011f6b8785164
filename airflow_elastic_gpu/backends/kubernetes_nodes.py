"""``airflow-elastic-gpu nodes kube-sync``: a Kubernetes cluster's GPU nodes registered in a pool of
the broker, with what the cluster says of their health (cordons, GPUs the device plugin no longer
offers, nodes that left the cluster)."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client import models as k8s

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.broker.service import GpuBroker

log = logging.getLogger(__name__)


def register_nodes_from_cluster(broker: GpuBroker, core_v1: Any, *, pool: str = "default",
                                label_selector: str | None = "nvidia.com/gpu.present=true") -> list[str]:
    """Register every GPU node of the cluster in ``pool``: GPU count from the ``nvidia.com/gpu.count``
    label (GPU feature discovery) or the ``nvidia.com/gpu`` capacity, type from ``nvidia.com/gpu.product``.

    What the cluster says of a node's health is carried over one way: a node cordoned in the cluster
    is drained, and a node whose ``nvidia.com/gpu`` allocatable is below its count (the device
    plugin found GPUs unhealthy) gets that many GPUs out of service, free ones first (a pod asking
    for GPUs the device plugin no longer offers would stay Pending); a node that is not Ready, or
    offers none (its kubelet or device plugin restarting), tells nothing of its GPUs. A new node is
    registered so from the start (no job is given GPUs that are taken back at once). A node whose
    GPU count went down has its GPUs above the count taken out of service, and a node of the pool
    that the cluster no longer lists (removed, say by an autoscaler, or no longer matching
    ``label_selector``) is drained: its jobs move off it, and no job is placed there for a pod
    that would stay Pending. None of this is undone here: the broker does not know whether an
    administrator did it (``nodes uncordon NODE [--gpu I]``; ``nodes remove NODE`` once it is
    empty).

    :returns: the registered node names.
    :raises BackendError: nodes listed are in another pool already (a node belongs to one pool);
        none is registered then.
    """
    found = []
    for node in core_v1.list_node(label_selector=label_selector).items:
        labels = node.metadata.labels or {}
        status = node.status or k8s.V1NodeStatus()
        count = labels.get("nvidia.com/gpu.count") or (status.capacity or {}).get("nvidia.com/gpu")
        if count and int(count) >= 1:
            offered = int((status.allocatable or {}).get("nvidia.com/gpu", count))
            ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
            if offered == 0 or (status.conditions and not ready):
                offered = int(count)  # a node restarting, or its device plugin: unknown, not unhealthy
            cordoned = bool(node.spec and node.spec.unschedulable)
            found.append((node.metadata.name, int(count), labels.get("nvidia.com/gpu.product", "nvidia"),
                          offered, cordoned))
    elsewhere = sorted(n.name for n in broker.nodes() if n.pool != pool and n.name in {f[0] for f in found})
    if elsewhere:
        raise BackendError(
            f"node(s) {', '.join(elsewhere[:5])}{' ...' if len(elsewhere) > 5 else ''} are in another GPU pool "
            f"already (a node belongs to one pool): give pool {pool!r} its own nodes with a label selector "
            "(kube-sync --label-selector)")
    known = {n.name for n in broker.nodes(pool)}
    for name, count, gpu_type, offered, cordoned in found:  # a new node as it is: no GPU offered, then taken back
        new = name not in known
        broker.register_node(name, count, pool=pool, gpu_type=gpu_type, cordoned=new and cordoned,
                             out_of_service=range(max(0, offered), count) if new else ())
    views = {n.name: n for n in broker.nodes(pool)}
    for name, count, _, offered, cordoned in found:
        view = views[name]
        if cordoned and view.schedulable:
            broker.set_node_schedulable(name, False, pool=pool)
        if beyond := [g.gpu.index for g in view.gpus if g.healthy and g.gpu.index >= count]:
            broker.set_gpus_healthy(name, beyond, False, pool=pool)  # the node has fewer GPUs now
        within = [g for g in view.gpus if g.gpu.index < count]  # the GPUs the node has now
        healthy = [g for g in within if g.healthy]
        if (missing := (count - max(0, offered)) - (len(within) - len(healthy))) > 0:
            # free GPUs first, the highest indices first; then held ones (a held one may be the failed device)
            order = sorted(healthy, key=lambda g: (g.in_use_by is not None or g.target_of is not None, -g.gpu.index))
            broker.set_gpus_healthy(name, [g.gpu.index for g in order[:missing]], False, pool=pool)
    listed = {f[0] for f in found}
    for view in views.values():
        if view.name not in listed and view.schedulable:
            log.warning("node %s of pool %s is no longer in the cluster's listing: drained", view.name, pool)
            broker.set_node_schedulable(view.name, False, pool=pool)
    return [f[0] for f in found]
