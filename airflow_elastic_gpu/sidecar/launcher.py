"""Launcher: runs the training command on the GPUs in ``desired.json`` and restarts it on a new generation.

It is the entry point of the training container (or process, locally), so it
uses only the standard library; copy ``launcher.py`` and ``protocol.py`` into any
image. Usage::

    python launcher.py --shared-dir DIR [--checkpoint-dir DIR] [--grace-s 30] -- CMD ...

``CMD`` is split like a shell would (``shlex``) after ``{num_gpus}`` is
replaced by the generation's GPU count. The trainer gets
``CUDA_VISIBLE_DEVICES``, ``ELASTIC_GPU_COUNT``, ``ELASTIC_GENERATION`` and
``ELASTIC_CHECKPOINT_DIR``; it runs in its own process group so that stopping
it (SIGTERM, then SIGKILL after ``--grace-s`` seconds) reaches every worker
``torchrun`` started. The launcher exits with the trainer's exit code when the
trainer ends by itself, 0 after a requested stop, 127 if the command is not found.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

try:  # inside the package
    from airflow_elastic_gpu.sidecar import protocol
except ImportError:  # copied next to protocol.py in a bare image
    import protocol  # type: ignore[no-redef]

EXIT_NOT_FOUND = 127


class Launcher:
    """Runs one job's trainer in ``shared_dir`` (see the module docstring)."""

    def __init__(
        self,
        shared_dir: Path,
        command: str,
        *,
        checkpoint_dir: Path | None = None,
        grace_s: float = 30.0,
        poll_s: float = 0.2,
        echo: bool = False,
    ) -> None:
        self.dir = shared_dir
        self.command = command
        self.checkpoint_dir = checkpoint_dir or shared_dir / "checkpoints"
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.restarts = 0
        self.tree: list[int] = []  # the trainer's descendants, refreshed every poll
        self._terminated = threading.Event()

    # -- files
    def _status(self, state: str, exit_code: int | None = None) -> None:
        protocol.write_json(
            self.dir / protocol.STATUS,
            {
                "generation": self.generation,
                "state": state,
                "pid": self.proc.pid if self.proc else None,
                "exit_code": exit_code,
                "restarts": self.restarts,
                "workers": self.tree,
                "time_s": time.time(),
            },
        )

    def _note(self, message: str) -> None:
        with open(self.dir / protocol.LOG, "a") as f:
            f.write(protocol.launcher_line(message))

    # -- trainer
    def _start(self, gpus: list[int]) -> None:
        argv = shlex.split(self.command.replace("{num_gpus}", str(len(gpus))))
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
            ELASTIC_GPU_COUNT=str(len(gpus)),
            ELASTIC_GENERATION=str(self.generation),
            ELASTIC_CHECKPOINT_DIR=str(self.checkpoint_dir),
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / protocol.LOG, "a") as f:
            f.write(protocol.generation_line(self.generation, f"on GPUs {gpus}: {shlex.join(argv)}"))
        log = open(self.dir / protocol.LOG, "ab")
        try:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=os.environ.get("ELASTIC_WORKDIR") or None, start_new_session=True,
            )
        finally:
            log.close()

    def _stop(self) -> int | None:
        """SIGTERM the trainer's process group, SIGKILL it after the grace period; its exit code."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        self._status(protocol.STOPPING)
        self._note(f"stopping trainer (pid {proc.pid}): SIGTERM, {self.grace_s:.0f}s grace")
        tree = sorted(set(self.tree) | set(protocol.descendants(proc.pid)))  # workers in their own sessions
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        try:
            proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            self._note("grace period over: SIGKILL")
            _signal_group(proc.pid, signal.SIGKILL)
            protocol.signal_processes(tree, signal.SIGKILL)
            proc.wait()
        # workers may still be writing their checkpoint: give them the rest of the grace period
        while any(protocol.pid_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)  # stray workers of the group
        protocol.signal_processes([p for p in tree if protocol.pid_alive(p)], signal.SIGKILL)
        self.tree = []
        return proc.returncode

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self._terminated.set())
        signal.signal(signal.SIGINT, lambda *_: self._terminated.set())
        if self.echo:
            threading.Thread(target=_follow, args=(self.dir / protocol.LOG,), daemon=True).start()
        self._status(protocol.STARTING)
        while True:
            if self._terminated.is_set():
                self._stop()
                self._status(protocol.STOPPED)
                return 0
            desired = protocol.read_json(self.dir / protocol.DESIRED) or {}
            if desired.get("stop"):
                self._stop()
                self._note("stopped on request")
                self._status(protocol.STOPPED)
                return 0
            gen = int(desired.get("generation", 0))
            if gen > self.generation and desired.get("gpus"):
                if self.proc is not None and self._stop() is not None:
                    self.restarts += 1
                self.generation = gen
                try:
                    self._start([int(g) for g in desired["gpus"]])
                except (FileNotFoundError, PermissionError) as exc:
                    self._note(f"command not found or not executable: {exc}")
                    self.proc = None
                    self._status(protocol.EXITED, EXIT_NOT_FOUND)
                    return EXIT_NOT_FOUND
                self._status(protocol.RUNNING)
            if self.proc is not None and self.proc.poll() is None:
                tree = protocol.descendants(self.proc.pid)
                if tree and tree != self.tree:  # kept in status.json so a stop from outside finds them
                    self.tree = tree
                    self._status(protocol.RUNNING)
            if self.proc is not None and self.proc.poll() is not None:
                protocol.signal_processes([p for p in self.tree if protocol.pid_alive(p)], signal.SIGKILL)
                code = self.proc.returncode
                self._note(f"trainer exited with code {code}")
                self._status(protocol.EXITED, code)
                return code if code >= 0 else 128 - code
            time.sleep(self.poll_s)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _follow(path: Path) -> None:
    """Copy what is appended to ``path`` to stdout (so container logs show the trainer)."""
    pos = 0
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared-dir", required=True, type=Path)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--echo", action="store_true", help="copy the trainer's log to stdout")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no training command given (put it after --)")
    args.shared_dir.mkdir(parents=True, exist_ok=True)
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    return Launcher(
        args.shared_dir, cmd, checkpoint_dir=args.checkpoint_dir,
        grace_s=args.grace_s, poll_s=args.poll_s, echo=args.echo,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
