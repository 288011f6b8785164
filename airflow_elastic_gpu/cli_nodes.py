"""``airflow-elastic-gpu nodes``: list a broker's nodes; add, detect, kube-sync, drain, uncordon or
remove one."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.backends.local import LOCAL_NODE
from airflow_elastic_gpu.backends.local_host import is_host_node
from airflow_elastic_gpu.broker.types import NodeView, NotFound


def cmd_nodes(args: argparse.Namespace) -> int:
    from airflow_elastic_gpu.cli import _broker, _known_pool, console, default_pool

    if args.gpu and args.action not in ("drain", "uncordon"):
        raise ValueError(f"--gpu goes with `nodes drain` or `nodes uncordon`, not `nodes {args.action}`")
    broker = _broker(args, existing=args.action in ("list", "drain", "uncordon", "remove"))
    args.pool_given = args.pool is not None
    args.name_given = args.name is not None
    if args.name is None:
        args.name = LOCAL_NODE
    if args.pool is None:
        args.pool = args.connection_pool or default_pool()
    if args.action == "list" and args.pool_given:
        _known_pool(broker, args.pool)
    if args.action == "add":
        if args.gpus is None or args.gpus < 1:
            raise ValueError(f"`nodes add {args.name}` needs --gpus N, the node's GPU count (1 or more)")
        if is_host_node(args.name):  # localhost-<i> too: the local backend runs it on this host's devices
            from airflow_elastic_gpu.backends.local import check_host_not_in_another_pool

            check_host_not_in_another_pool(broker, args.pool)
        _kept(broker.register_node(args.name, args.gpus, pool=args.pool, gpu_type=args.gpu_type), args.gpus)
    elif args.action == "kube-sync":
        try:
            from airflow.exceptions import AirflowException, AirflowNotFoundException
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
            from kubernetes.client.exceptions import ApiException
            from kubernetes.config.config_exception import ConfigException
            from urllib3.exceptions import HTTPError
        except ImportError as exc:
            raise BackendError(f"kube-sync needs Airflow's Kubernetes provider ({exc}): "
                               "pip install 'airflow-elastic-gpu[airflow]'") from None

        from airflow_elastic_gpu.backends.kubernetes_config import with_request_timeout
        from airflow_elastic_gpu.backends.kubernetes_nodes import register_nodes_from_cluster

        try:
            core_v1 = with_request_timeout(KubernetesHook(conn_id=args.kubernetes_conn_id).core_v1_client)
        except AirflowNotFoundException:
            raise BackendError(f"no Airflow connection {args.kubernetes_conn_id!r}: define it (a Kubernetes "
                               "connection), or name another with --kubernetes-conn-id") from None
        except (ConfigException, AirflowException) as exc:  # no kube-config, no in-cluster account; clashing fields
            raise BackendError(f"no Kubernetes cluster to read through connection {args.kubernetes_conn_id!r}: "
                               f"{exc} (set the connection's kube_config_path, or run in the cluster)") from None
        try:
            names = register_nodes_from_cluster(broker, core_v1, pool=args.pool, label_selector=args.label_selector)
        except ConfigException as exc:  # a token refreshed as the nodes are listed (a cmd-path, oidc)
            raise BackendError(f"the cluster of connection {args.kubernetes_conn_id!r}: {exc}") from None
        except ApiException as exc:  # a 401/403 (the connection's rights: nodes, list), a 5xx
            raise BackendError(f"the cluster of connection {args.kubernetes_conn_id!r} refused to list its nodes: "
                               f"{exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:  # not reached (urllib3 retried, then gave up)
            server = getattr(getattr(core_v1, "api_client", None), "configuration", None)
            raise BackendError(f"cannot reach the cluster of connection {args.kubernetes_conn_id!r}"
                               f"{f' at {server.host}' if server is not None else ''}: {exc}") from None
        console.print(f"registered {len(names)} GPU node(s) of the cluster in pool {escape(repr(args.pool))}")
    elif args.action in ("drain", "uncordon", "remove"):
        if not args.name_given:
            raise ValueError(f"`nodes {args.action}` needs the node's NAME (see `nodes list`)")
        if not args.pool_given:  # a node name is in one pool only: its own
            pools = [n.pool for n in broker.nodes() if n.name == args.name]
            if not pools:
                raise NotFound(f"unknown node {args.name!r} (`nodes list` shows the nodes of every pool)")
            args.pool = pools[0]
        if args.gpu:  # one failing GPU, not the whole node
            broker.set_gpus_healthy(args.name, args.gpu, args.action == "uncordon", pool=args.pool)
        elif args.action == "remove":
            broker.remove_node(args.name, pool=args.pool)
            console.print(f"removed node {escape(repr(args.name))} from pool {escape(repr(args.pool))}")
        else:
            broker.set_node_schedulable(args.name, args.action == "uncordon", pool=args.pool)
    elif args.action == "detect":
        from airflow_elastic_gpu.backends.local import check_host_not_in_another_pool, detect_gpus
        from airflow_elastic_gpu.backends.local_host import register_host_gpus
        from airflow_elastic_gpu.config import default_work_dir

        check_host_not_in_another_pool(broker, args.pool)
        found = detect_gpus(args.virtual_gpus)
        # under the host's claim, as a job's start registers them (LocalBackend.ensure_pool)
        _kept(register_host_gpus(default_work_dir(), broker, args.pool, found), len(found.indices))
    table = Table(title="nodes")
    for col in ("pool", "node", "schedulable", "GPUs", "type", "in use", "out of service"):
        table.add_column(col)
    # list: the pool named with --pool, else every pool; add/detect/kube-sync: every pool (the new
    # node among them)
    shown = broker.nodes(args.pool if args.action == "list" and args.pool_given else None)
    if args.action == "list" and args.name_given:  # `nodes list NAME`: that node only
        shown = [n for n in shown if n.name == args.name]
        if not shown:
            raise NotFound(f"unknown node {args.name!r}"
                           + (f" in pool {args.pool!r}" if args.pool_given else "") + " (`nodes list` shows every node)")
    for n in shown:
        table.add_row(Text(n.pool), Text(n.name), "yes" if n.schedulable else "no", str(len(n.gpus)),
                      Text(n.gpus[0].gpu_type) if n.gpus else "-",
                      str(sum(g.in_use_by is not None for g in n.gpus)),
                      ", ".join(str(g.gpu.index) for g in n.gpus if not g.healthy) or "-")
    console.print(table)
    return 0


def _kept(view: NodeView, asked: int) -> None:
    """Say so when a node registered again keeps more GPUs than it was given now."""
    from airflow_elastic_gpu.cli import notes

    if len(view.gpus) > asked:
        notes.print(f"node {view.name!r} keeps its {len(view.gpus)} GPUs: registering again never removes one "
                    f"(`nodes drain {view.name}`, then `nodes remove` and add it again)",
                    style="yellow", markup=False, highlight=False, soft_wrap=True)


def add_nodes_command(sub: argparse._SubParsersAction) -> None:
    """Add ``nodes`` to the CLI's subcommands."""
    from airflow_elastic_gpu.cli import POOL_DEFAULT

    p = sub.add_parser("nodes", help="list nodes; add one; detect this host's GPUs; or register a Kubernetes "
                                     "cluster's GPU nodes")
    p.add_argument("action", nargs="?", choices=["list", "add", "detect", "kube-sync", "drain", "uncordon", "remove"],
                   default="list", metavar="ACTION",
                   help="list (default): the nodes and their GPUs; add NAME --gpus N: register a node; "
                        "detect: register this host's GPUs (nvidia-smi, else --virtual-gpus); kube-sync: "
                        "register the Kubernetes cluster's GPU nodes (GPU feature discovery labels); "
                        "drain NAME: no new GPUs of the node to any job, its jobs moved off it (with --gpu: "
                        "those GPUs only, out of service); uncordon NAME: schedulable (or with --gpu: in "
                        "service) again; remove NAME: take a node none of whose GPUs a job holds "
                        "(drain it first if one does) out of its pool (to retire it, or register it in another pool)")
    p.add_argument("--kubernetes-conn-id", default="kubernetes_default",
                   help="Airflow connection of the cluster (kube-sync; default kubernetes_default)")
    p.add_argument("--label-selector", default="nvidia.com/gpu.present=true",
                   help="which of the cluster's nodes have GPUs (kube-sync; default nvidia.com/gpu.present=true)")
    p.add_argument("name", nargs="?", default=None,
                   help=f"node name (add: default {LOCAL_NODE!r}; drain, uncordon, remove: required; list: that node only)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs on the node (add)")
    p.add_argument("--gpu", type=int, action="append", default=None, metavar="INDEX",
                   help="drain/uncordon: only this GPU of the node (a failing one: Xid or ECC errors); repeat for several")
    p.add_argument("--gpu-type", default=None,
                   help="GPU model, e.g. \"NVIDIA H100\" (add; a new node's default: virtual; a node added "
                        "before keeps its type unless given)")
    p.add_argument("--virtual-gpus", type=int, default=None, help="virtual GPUs when none is found (detect)")
    p.add_argument("--pool", default=None,
                   help=f"add/detect/kube-sync/drain/uncordon/remove: the nodes' GPU pool (default {POOL_DEFAULT}); "
                        "list: only this pool's nodes (default every pool)")
    p.set_defaults(fn=cmd_nodes)
