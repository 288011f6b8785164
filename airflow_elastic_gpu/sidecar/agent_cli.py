"""The agent's process: its command line, the broker transport it chooses, its signal handling.

``python -m airflow_elastic_gpu.sidecar.agent ...`` runs :func:`main` (the backends start it so);
the relay itself is :class:`~airflow_elastic_gpu.sidecar.agent.Agent`. The HTTP transport (a pod:
the job's token, no database) or the broker's own code (the local backend: direct database
access) is imported only once chosen.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from airflow_elastic_gpu.sidecar.agent import DEFAULT_LEASE_S, Agent
from airflow_elastic_gpu.sidecar.calls import BrokerTransport


def on_signal(call: Callable[[], None]) -> Callable[..., None]:
    """A signal handler that runs ``call`` in a thread of its own. A handler runs in the main thread
    between two bytecodes, perhaps while that thread holds the lock ``call`` takes (``Event.set``
    while ``Event.wait`` holds its condition's lock for an instant): run there, ``call`` would wait
    for its own thread for ever, and the agent would hang with the trainer's GPUs."""
    return lambda *_: threading.Thread(target=call, name="signal", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="elastic-GPU sidecar agent")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--shared-dir", required=True, type=Path)
    parser.add_argument("--broker-url", default=None, help="broker DB URL (default: $AIRFLOW_ELASTIC_GPU_BROKER_URL)")
    parser.add_argument("--broker-api", default=os.environ.get("AIRFLOW_ELASTIC_GPU_BROKER_API"),
                        help="broker HTTP API root; with it the agent uses the job's token, not the DB")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding the job's API token (default: $AIRFLOW_ELASTIC_GPU_JOB_TOKEN)")
    parser.add_argument("--progress-pattern", default=None)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--launcher-pid", type=int, action="append", default=None,
                        help="a local launcher's pid (repeated for a gang job: one per node)")
    parser.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S,
                        help="the broker's lease of the job's pool, seconds (the broker's answer wins where it gives one)")
    parser.add_argument("--fence-s", type=float, default=None,
                        help="stop the trainer after this long without a confirmed contact (default: lease/2)")
    parser.add_argument("--fence-margin-s", type=float, default=None,
                        help="the trainer is dead this long before the lease ends (default: max(1, lease/10))")
    parser.add_argument("--host-node", default=None,
                        help="the node this pod runs on: a generation on another node is left to a new pod there")
    parser.add_argument("--pod-generation", type=int, default=None,
                        help="the one generation this pod runs (a pod re-created per generation): newer ones "
                             "are left to the backend, which replaces the pod")
    parser.add_argument("--node", default=None,
                        help="this pod's node in a gang with one agent per node: run and ack that node's part")
    parser.add_argument("--gang-domain", default="",
                        help="with --node: the DNS domain of the gang's pods (SERVICE.NAMESPACE.svc)")
    parser.add_argument("--rendezvous-port", type=int, default=29500,
                        help="with --node: the rendezvous port at the rank-0 node's pod")
    parser.add_argument("--stop-timeout-s", type=float, default=60.0,
                        help="how long a stop waits for the trainer (at least the launcher's --grace-s): a job's "
                             "end is reported, and its GPUs freed, only once its trainer stopped")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker: BrokerTransport
    if args.broker_api:
        from airflow_elastic_gpu.sidecar.http_transport import HttpBrokerTransport

        token = "" if args.token_file else os.environ.get("AIRFLOW_ELASTIC_GPU_JOB_TOKEN", "")
        broker = HttpBrokerTransport(args.broker_api, token, token_file=args.token_file)  # re-read per request
    else:  # direct DB access (the local backend): the broker's code is needed only here
        from airflow_elastic_gpu.broker.service import GpuBroker

        broker = GpuBroker(args.broker_url, migrate=False)
    agent = Agent(
        broker, args.job_id, args.shared_dir, progress_pattern=args.progress_pattern,
        poll_s=args.poll_s, launcher_pid=args.launcher_pid, lease_s=args.lease_s, fence_s=args.fence_s,
        fence_margin_s=args.fence_margin_s, pod_generation=args.pod_generation, node=args.node,
        host_node=args.host_node,
        gang_domain=args.gang_domain, rendezvous_port=args.rendezvous_port, stop_timeout_s=args.stop_timeout_s,
    )
    signal.signal(signal.SIGTERM, on_signal(agent.terminate))
    return agent.run()

