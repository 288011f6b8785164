"""A job on several nodes: one launcher per node, driven together by the job's one agent.

A gang job's directory holds ``nodes/<node name>/`` per node of its pool (each a launcher's
shared directory, see :mod:`.protocol`) and the agent's own ``desired.json`` (the last
generation it wrote, with the GPUs as ``[node, index]`` pairs). A resize of a gang is a **gang
resize**: the agent writes the new generation to every node's ``desired.json`` at once (nodes the
generation does not use are suspended), every launcher stops its trainer (SIGTERM: the trainer
checkpoints) and the nodes in the generation restart it with the new ``nnodes``, ``node_rank``
and rendezvous endpoint; the agent acks the generation only when every one of them runs it. One
node's trainer failing, or one node's launcher dying, stops the whole gang and fails the job:
half a job never runs on. A node whose trainer exits with 0 while another's still runs (global
rank 0 evaluating) makes the gang *finishing*: the agent reports that node to the broker (which
then keeps the allocation fixed) and publishes no newer generation until the job ends.

The rendezvous: node rank 0 (the first node by name) hosts it; on one host (virtual nodes) the
address is 127.0.0.1 and the port a free one picked for each generation. The trainer's global rank
0, which prints the progress, may be on any node (torchrun's ``c10d`` rendezvous assigns ranks in
arrival order), so the agent reads every node's log.

On Kubernetes the nodes share no directory: each node's pod has its own agent, which takes its
node's part of the same :func:`gang_plan` and acks its node (see
``Agent(node=...)``); the rendezvous is the rank-0 node's pod, found through the job's headless
Service by the host name :func:`pod_hostname` gives it.
"""

from __future__ import annotations

import hashlib
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_elastic_gpu.sidecar import protocol, stops


def gang_plan(gpus: list[tuple[str, int]], master_addr: str, master_port: int) -> dict[str, dict[str, Any]]:
    """Split a generation's GPUs (``(node, device index)`` pairs) into one ``desired.json`` part per node.

    Nodes are ranked by name (rank 0 hosts the rendezvous at ``master_addr:master_port``); each part
    is ``{"gpus": [indices], "nnodes": int, "node_rank": int, "master_addr": str, "master_port": int}``.

    :returns: node name -> its part (nodes without GPUs in the generation are absent).
    """
    by_node: dict[str, list[int]] = {}
    for node, index in sorted(gpus):
        by_node.setdefault(node, []).append(index)
    return {node: {"gpus": indices, "nnodes": len(by_node), "node_rank": rank, "master_addr": master_addr,
                   "master_port": master_port}
            for rank, (node, indices) in enumerate(sorted(by_node.items()))}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; it stays free until someone binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pod_hostname(node: str) -> str:
    """The host name (a DNS-1123 label, at most 63 characters) of a gang's pod on ``node``.

    A node name that is a label already is kept (``gpu-node-7``); any other (dots, capitals, too
    long) is cleaned and suffixed with 8 hex digits of its sha1, so two nodes never share one.
    """
    clean = re.sub(r"[^a-z0-9-]", "-", node.lower()).strip("-")
    if clean == node and 0 < len(clean) <= 63:
        return clean
    digest = hashlib.sha1(node.encode()).hexdigest()[:8]
    return f"{clean[:54].strip('-')}-{digest}".lstrip("-")


def rendezvous_address(node: str, domain: str) -> str:
    """The DNS name of ``node``'s pod in a gang whose headless Service is ``domain``
    (``SERVICE.NAMESPACE.svc``): ``HOSTNAME.SERVICE.NAMESPACE.svc``."""
    return f"{pod_hostname(node)}.{domain}"


def node_part(gpus: list[tuple[str, int]], node: str, domain: str, port: int) -> dict[str, Any]:
    """``node``'s part of a generation's GPUs (``(node, device index)`` pairs) in a gang with one
    agent per node: its entry of :func:`gang_plan` with the rank-0 node's pod
    (:func:`rendezvous_address` in ``domain``) at ``port`` as the rendezvous, or ``{"gpus": []}``
    (suspended) when the generation does not use ``node``."""
    nodes = sorted({n for n, _ in gpus})
    if not nodes:
        return {"gpus": []}
    plan = gang_plan(gpus, rendezvous_address(nodes[0], domain), port)
    return plan.get(node, {"gpus": []})


def node_dirs(job_dir: Path) -> dict[str, Path]:
    """Node name -> launcher directory of a gang job (empty for a job on one launcher)."""
    root = job_dir / protocol.NODES
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir()}


@dataclass
class Gang:
    """The launchers of one gang job (``dirs``: node name -> launcher directory).

    :param master_addr: the rendezvous address the trainers reach rank 0's node at.
    """

    dirs: dict[str, Path]
    master_addr: str = "127.0.0.1"
    rank0: dict[int, str] = field(default_factory=dict)  # generation -> its node rank 0 (rendezvous host)

    def __post_init__(self) -> None:  # an agent restarted mid-job: which node was rank 0
        for node in self.dirs:
            desired = self.desired(node)
            if desired.get("gpus") and desired.get("node_rank") == 0:
                self.rank0[int(desired.get("generation", 0))] = node

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {node: protocol.read_json(d / protocol.STATUS) or {} for node, d in self.dirs.items()}

    def desired(self, node: str) -> dict[str, Any]:
        return protocol.read_json(self.dirs[node] / protocol.DESIRED) or {}

    def using(self) -> list[str]:
        """The nodes the last generation written runs on (the others are suspended)."""
        return [n for n in self.dirs if self.desired(n).get("gpus")]

    def publish(self, generation: int, gpus: list[tuple[str, int]]) -> dict[str, dict[str, Any]]:
        """Write ``generation`` to every node: its part of :func:`gang_plan`, or no GPUs
        (the node is suspended) where the generation does not use it. A generation with no GPUs
        suspends the whole job (every node).

        :raises ValueError: a GPU on a node this job has no launcher for.
        """
        unknown = sorted({node for node, _ in gpus} - set(self.dirs))
        if unknown:
            raise ValueError(f"generation {generation} names node(s) {unknown} this job has no launcher on")
        plan = gang_plan(gpus, self.master_addr, free_port()) if gpus else {}
        for node, d in self.dirs.items():
            part = plan.get(node, {"gpus": []})
            protocol.write_json(d / protocol.DESIRED, {"generation": generation, "stop": False, **part})
        if plan:
            self.rank0[generation] = min(plan)
        return plan

    def resume(self, node: str, fences: int) -> None:
        """Let ``node``'s fenced launcher restart its trainer on the same generation."""
        desired = self.desired(node)
        desired["resume"] = fences
        protocol.write_json(self.dirs[node] / protocol.DESIRED, desired)

    def stop(self) -> None:
        """Ask every launcher to stop its trainer and exit."""
        for d in self.dirs.values():
            stops.request_stop(d, "the job ended")

    def write_all(self, name: str, data: dict[str, Any]) -> None:
        """Write ``data`` as file ``name`` into every node's directory (the lease)."""
        for d in self.dirs.values():
            protocol.write_json(d / name, data)

    def status(self, generation: int) -> dict[str, Any]:
        """One ``status.json``-like view of the gang for the agent, for the generation it wrote.

        ``state`` is ``exited`` with the first non-zero exit code of any node (``node`` names it),
        or with 0 once every node of the generation has exited 0; ``stopped`` if a launcher was
        stopped from outside; ``fenced`` if a node of the generation is fenced; ``running`` once
        every node of the generation runs it **and** every other node is suspended on it (its
        previous trainer stopped: the broker frees that node's GPUs on the ack); ``suspended``
        once every node is suspended on a generation with no GPUs (the job is suspended: its
        trainers checkpointed and stopped); else ``starting``.
        ``pid`` and ``workers``: every node's trainer processes (to kill orphans).
        """
        statuses = self.statuses()
        using = self.using()
        pids = [s["pid"] for s in statuses.values() if s.get("pid")]
        workers = [w for s in statuses.values() for w in s.get("workers") or []]
        base = {"generation": generation, "pid": None, "workers": pids + workers,
                "fences": max((int(s.get("fences") or 0) for s in statuses.values()), default=0)}
        for node, s in statuses.items():
            if protocol.failed_exit(s):
                return {**base, "state": protocol.EXITED, "exit_code": protocol.exit_code(s), "node": node}
        if any(s.get("state") == protocol.STOPPED for s in statuses.values()):
            return {**base, "state": protocol.STOPPED}
        of_gen = [statuses[n] for n in using]
        if of_gen and all(s.get("state") == protocol.EXITED for s in of_gen):
            return {**base, "state": protocol.EXITED, "exit_code": 0}
        if any(s.get("state") == protocol.FENCED for s in of_gen):
            return {**base, "state": protocol.FENCED}
        # a node the generation no longer uses may still run the previous generation's trainer on
        # GPUs the broker frees on the ack: the gang runs the generation only once those stopped too
        dropped = [statuses[n] for n in self.dirs if n not in using]
        if not of_gen and all(s.get("state") == protocol.SUSPENDED and int(s.get("generation", 0)) >= generation
                              for s in dropped):
            return {**base, "state": protocol.SUSPENDED}
        if (of_gen and all(s.get("state") == protocol.RUNNING and int(s.get("generation", 0)) == generation
                           for s in of_gen)
                and all(s.get("state") == protocol.SUSPENDED and int(s.get("generation", 0)) >= generation
                        for s in dropped)):
            return {**base, "state": protocol.RUNNING}
        return {**base, "state": protocol.STARTING}
