"""``airflow-elastic-gpu broker serve``: the broker's HTTP API (the sidecars' calls, the read-only
views) and the GPU pool page, as a stand-alone server (:mod:`airflow_elastic_gpu.broker.api`)."""

from __future__ import annotations

import argparse
import errno
import socket

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.cli_parsing import port
from airflow_elastic_gpu.config import airflow_conf, default_broker_url, get_option, mask_url


def cmd_broker(args: argparse.Namespace) -> int:
    """``broker serve``: the broker HTTP API and the GPU pool page, until Ctrl-C."""
    from airflow_elastic_gpu.cli import _broker, console

    try:
        import uvicorn

        from airflow_elastic_gpu.broker.api import check_bind_address, create_app
        from airflow_elastic_gpu.broker.api_guards import ApiLimits
    except ImportError as exc:
        raise BackendError(f"the broker server needs the api extra ({exc}): "
                           "pip install 'airflow-elastic-gpu[api]'") from None

    # through Airflow's conf where Airflow is installed: its _CMD and _SECRET forms of the token
    # (AIRFLOW__ELASTIC_GPU__UI_TOKEN_CMD), which a plain read of the environment does not see;
    # stripped, as a command's output ends with a newline that no client sends
    ui_token = get_option("ui_token", conf=airflow_conf()).strip() or None
    check_bind_address(args.host, ui_token)
    overrides = {k: v for k, v in (("max_body_bytes", args.max_body_bytes),
                                   ("max_metrics_bytes", args.max_metrics_bytes)) if v is not None}
    limits = ApiLimits.from_env(given=overrides)  # before the database is touched (or migrated)
    check_port_free(args.host, args.port)  # so is the port
    # the database answers before the server does: a bad or unreachable URL is one line and exit 2
    # here, not a server whose every API call fails with 500 behind a page that loads
    probe = _broker(args)
    probe.pools()
    probe.engine.dispose()
    app = create_app(broker_url=args.broker_url or default_broker_url(), ui_token=ui_token, limits=limits,
                     api_docs=args.api_docs)
    shown = mask_url(args.broker_url or default_broker_url())
    docs = "; Swagger UI: /docs (assets from a CDN)" if args.api_docs else ""
    views = "need the UI token" if ui_token else "open (loopback only)"
    console.print(f"broker API on http://{args.host}:{args.port} (page: /ui; OpenAPI: /openapi.json{docs}) "
                  f"for {shown}; read-only views {views}; bodies up to {limits.max_body_bytes} bytes",
                  markup=False, highlight=False)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def check_port_free(host: str, port: int) -> None:
    """Bind ``port`` on every address of ``host`` as uvicorn (asyncio's ``create_server``) will:
    ``SO_REUSEADDR``, IPv6 sockets ``IPV6_V6ONLY``, ``""`` for every interface.

    :raises BackendError: one cannot be listened on: another server has the port (the server said
        it listened, then uvicorn's error and exit 3), or the address is not this host's."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BackendError(f"--host {host}: {exc}") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                where = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise BackendError(f"cannot listen on {where}: not an address of this host; give "
                                       "another --host") from None
                hint = " (Airflow's worker log server listens on 8793 by default)" if port == 8793 else ""
                raise BackendError(f"cannot listen on {where}: {exc.strerror}{hint}; give another --port") from None


def add_broker_command(sub: argparse._SubParsersAction) -> None:
    """Add ``broker`` to the CLI's subcommands."""
    p = sub.add_parser("broker", help="serve the broker HTTP API and the GPU pool page")
    p.add_argument("action", choices=["serve"], help="serve: run the server until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any but a loopback one needs "
                        "the UI token ($AIRFLOW_ELASTIC_GPU_UI_TOKEN or [elastic_gpu] ui_token)")
    p.add_argument("--port", type=port, default=8793, help="TCP port (default 8793)")
    p.add_argument("--api-docs", action="store_true",
                   help="also serve Swagger UI (/docs) and ReDoc (/redoc); their assets load from a CDN")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (default $AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES or 262144)")
    p.add_argument("--max-metrics-bytes", type=int, default=None,
                   help="largest metrics of a finish/fail report (default "
                        "$AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES or 16384)")
    p.set_defaults(fn=cmd_broker)
