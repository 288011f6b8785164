"""A private PostgreSQL server in a temporary directory, for tests and benchmarks that restart it.

Never the shared server: ``initdb`` makes a new cluster in a temporary directory, ``pg_ctl`` runs it
on a free port on 127.0.0.1 (trust authentication, user ``postgres``), and :meth:`restart` does what
an operator's ``pg_ctl restart -m fast`` does (every client connection is cut).
PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` system user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def pg_tool(name: str) -> str | None:
    """Path of a PostgreSQL server tool (``initdb``, ``pg_ctl``), or None if not installed."""
    found = shutil.which(name)
    if found:
        return found
    for d in PG_BIN_DIRS:
        if (d / name).exists():
            return str(d / name)
    return None


def available() -> bool:
    return pg_tool("initdb") is not None and pg_tool("pg_ctl") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivatePostgres:
    """Start with ``with PrivatePostgres() as pg: pg.url ...``; stopped and deleted on exit.

    :raises RuntimeError: the tools are missing or the server does not start (the log is quoted).
    """

    def __init__(self) -> None:
        if not available():
            raise RuntimeError("initdb/pg_ctl not found (Debian: apt-get install postgresql)")
        self.root = Path(tempfile.mkdtemp(prefix="aeg-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, "postgres")
        self._run(pg_tool("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str | None, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(a) for a in argv]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if check and out.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stdout}{out.stderr}{log}")
        return out

    def _ctl(self, action: str, *extra: str) -> None:
        self._run(pg_tool("pg_ctl"), action, "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off", *extra)

    def start(self) -> PrivatePostgres:
        self._ctl("start")
        return self

    def restart(self) -> float:
        """``pg_ctl restart -m fast`` (clients are disconnected); returns the seconds it took."""
        t0 = time.monotonic()
        self._ctl("restart", "-m", "fast")
        return time.monotonic() - t0

    def stop(self) -> None:
        self._run(pg_tool("pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-w", check=False)

    def __enter__(self) -> PrivatePostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
