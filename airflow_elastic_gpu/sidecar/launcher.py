"""Launcher: runs the training command on the GPUs in ``desired.json`` and restarts it on a new generation.

It is the entry point of the training container (or process, locally), so it
uses only the standard library; copy ``launcher.py`` and ``protocol.py`` into any
image. Usage::

    python launcher.py --shared-dir DIR [--checkpoint-dir DIR] [--grace-s 30] -- CMD ...

``CMD`` is split like a shell would (``shlex``) after ``{num_gpus}`` is replaced by the generation's GPU
count on this node (and, for a job on several nodes, ``{nnodes}``, ``{node_rank}``, ``{master_addr}`` and
``{master_port}``, see :data:`protocol.PLACEHOLDERS`). The trainer gets ``CUDA_VISIBLE_DEVICES``,
``ELASTIC_GPU_COUNT``, ``ELASTIC_GENERATION``, ``ELASTIC_NNODES``, ``ELASTIC_NODE_RANK`` and
``ELASTIC_CHECKPOINT_DIR``; it runs in its own process group so that stopping it (SIGTERM, then SIGKILL
after ``--grace-s`` seconds) reaches every worker ``torchrun`` started. The launcher exits with the
trainer's exit code when the trainer ends by itself, 0 after a requested stop, 127 if the command is not
found. A trainer that is one node of a gang (``nnodes`` > 1) and exits non-zero is given ``--peer-wait-s``
(5 s), or the longer ``peer_wait_s`` of the agent's lease (a gang of pods: 34 s), for the gang's next
generation or a stop: each node sees a generation at its own poll, and a peer's trainer stopped first breaks
the others' rendezvous, so that exit is the resize's stop (the trainer restarts on the new generation from
its checkpoint), not a failure.

Fencing: once the agent has written ``lease.json`` (its last confirmed contact with the broker, see
:mod:`protocol`), the launcher stops the trainer **on its own** when that contact is older than the lease's
``fence_s`` (SIGTERM, then SIGKILL of the whole process tree no later than ``kill_s``), or when the agent's
process (locally: its pid) has been gone that long; state ``fenced``. It starts no trainer while the lease
is stale, restarts the fenced one only when the agent, back in contact, writes ``resume`` (the broker still
runs the job with that generation) or a newer generation, and exits with 75 (``EX_TEMPFAIL``) once its agent
has been gone for a whole lease after a fence (the broker has declared the job lost by then).
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
EXIT_FENCED = 75  # EX_TEMPFAIL: fenced, and no agent came back to resume the trainer
STUCK_NOTE_S = 60.0  # how often a process that survives SIGKILL is named again in train.log


class LeaseWatch:
    """The launcher's view of ``lease.json``: how long since the agent's last confirmed contact.

    The age of a contact is measured twice and the larger is used: on the wall clock from the
    ``contact_s`` the agent wrote (the agent and the launcher share a host, so a clock offset
    cancels out), and on this process's monotonic clock from when the launcher first saw that
    contact (minus its wall-clock age then), so that the wall clock stepping back cannot postpone
    a fence. A stepping forward only fences early.
    """

    def __init__(self) -> None:
        self.periods: protocol.FencePeriods | None = None  # None: no lease yet, fencing not armed
        self.contact_s: float | None = None
        self._seen_mono = 0.0
        self.agent_pid: int | None = None
        self._agent_gone_mono: float | None = None
        self.peer_wait_s = 0.0  # the agent's: how much later a peer's agent may see a generation

    def update(self, data: dict | None, now_s: float, now_mono: float) -> None:
        """Take in the current ``lease.json`` (``None``: not written yet); a malformed file
        changes nothing (the last good contact keeps ageing)."""
        if data is not None:
            try:
                contact = float(data["contact_s"])
                periods = protocol.FencePeriods(float(data["lease_s"]), float(data["fence_s"]),
                                                float(data["kill_s"]))
                agent_pid = int(data["agent_pid"]) if data.get("agent_pid") else None
                peer_wait_s = float(data.get("peer_wait_s") or 0.0)
            except (KeyError, TypeError, ValueError):
                pass
            else:
                if 0.0 <= peer_wait_s < float("inf"):  # NaN or negative: the launcher's own wait
                    self.peer_wait_s = min(peer_wait_s, periods.lease_s)
                if contact != self.contact_s:
                    self.contact_s = contact
                    self._seen_mono = now_mono - max(0.0, now_s - contact)
                self.periods = periods
                if agent_pid != self.agent_pid:
                    self.agent_pid, self._agent_gone_mono = agent_pid, None
        if self.agent_pid is not None and not protocol.pid_alive(self.agent_pid):
            if self._agent_gone_mono is None:
                self._agent_gone_mono = now_mono
        else:
            self._agent_gone_mono = None

    def age_s(self, now_s: float, now_mono: float) -> float:
        """Seconds since the last confirmed contact (0 when fencing is not armed)."""
        if self.contact_s is None:
            return 0.0
        return max(now_s - self.contact_s, now_mono - self._seen_mono)

    def agent_gone_s(self, now_mono: float) -> float:
        """Seconds since the launcher first saw the agent's process gone (0 while it runs, or
        when its pid is not known: the agent runs in another pid namespace)."""
        return 0.0 if self._agent_gone_mono is None else now_mono - self._agent_gone_mono

    def fence_reason(self, now_s: float, now_mono: float) -> str | None:
        """Why the trainer must not run now, or ``None`` while the lease is fresh (or not armed)."""
        if self.periods is None:
            return None
        age = self.age_s(now_s, now_mono)
        if age >= self.periods.fence_s:
            return (f"no confirmed contact with the broker for {age:.1f}s "
                    f"(fence {self.periods.fence_s:g}s, lease {self.periods.lease_s:g}s)")
        gone = self.agent_gone_s(now_mono)
        if gone >= self.periods.fence_s:
            return f"the agent (pid {self.agent_pid}) has been gone for {gone:.1f}s"
        return None


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
        peer_wait_s: float = 5.0,
    ) -> None:
        self.dir = shared_dir
        self.command = command
        self.checkpoint_dir = checkpoint_dir or shared_dir / "checkpoints"
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.echo = echo
        self.peer_wait_s = peer_wait_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.nnodes = 1  # the running generation's node count (a gang's part: > 1)
        self.restarts = 0
        self.suspended = False
        self.tree: list[int] = []  # the trainer's descendants, refreshed every poll
        self.lease = LeaseWatch()
        self.fences = 0  # how many times the trainer was fenced
        self.fenced = False  # the trainer was fenced and has not been restarted since
        self.fenced_s: float | None = None
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
                "fences": self.fences,
                "fenced_s": self.fenced_s,
                "launcher_pid": os.getpid(),
                "time_s": time.time(),
            },
        )

    def _note(self, message: str) -> None:
        self._append(protocol.launcher_line(message))

    def _append(self, line: str) -> None:
        """Append one of the launcher's lines to the log, on a line of its own: a trainer killed in
        the middle of a line (or whose last line has no newline: its final metrics) would otherwise
        have the launcher's line glued to it, and neither would parse."""
        path = self.dir / protocol.LOG
        with open(path, "a+b") as f:
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(line.encode())

    # -- trainer
    def _start(self, desired: dict) -> None:
        gpus = [int(g) for g in desired["gpus"]]
        self.nnodes = int(desired.get("nnodes") or 1)
        argv = shlex.split(protocol.expand_command(self.command, desired))
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
            ELASTIC_GPU_COUNT=str(len(gpus)),
            ELASTIC_GENERATION=str(self.generation),
            ELASTIC_NNODES=str(desired.get("nnodes", 1)),
            ELASTIC_NODE_RANK=str(desired.get("node_rank", 0)),
            ELASTIC_CHECKPOINT_DIR=str(self.checkpoint_dir),
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._append(protocol.generation_line(self.generation, f"on GPUs {gpus}: {shlex.join(argv)}"))
        log = open(self.dir / protocol.LOG, "ab")
        try:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=os.environ.get("ELASTIC_WORKDIR") or None, start_new_session=True,
            )
        finally:
            log.close()

    def _stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the trainer's process group, SIGKILL it after ``grace_s`` (default ``--grace-s``)
        seconds, and every worker found below it; its exit code.

        The grace period never runs past the lease's ``kill_s`` as of now (the agent may stop
        renewing it during the stop: a cancelled job's agent does, and the broker frees the GPUs
        a lease after the last heartbeat)."""
        grace_s = self.grace_s if grace_s is None else max(0.0, grace_s)
        periods = self.lease.periods
        if periods is not None:
            grace_s = max(0.0, min(grace_s, periods.kill_s - self.lease.age_s(time.time(), time.monotonic())))
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is not None:
            # it exited by itself (a crash, a SIGKILL): workers in sessions of their own may live
            # on, on the GPUs the next generation frees
            self._kill_workers()
            return proc.returncode
        self._status(protocol.STOPPING)
        self._note(f"stopping trainer (pid {proc.pid}): SIGTERM, {grace_s:.1f}s grace")
        tree = sorted(set(self.tree) | set(protocol.descendants(proc.pid)))  # workers in their own sessions
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._note("grace period over: SIGKILL")
            _signal_group(proc.pid, signal.SIGKILL)
            protocol.signal_processes(tree, signal.SIGKILL)
            proc.wait()
        # workers may still be writing their checkpoint: give them the rest of the grace period
        while any(protocol.pid_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)  # stray workers of the group
        self.tree = tree
        self._kill_workers()
        return proc.returncode

    def _kill_workers(self) -> None:
        """SIGKILL the trainer's recorded workers still alive, wait for them to be gone, forget them. One
        stuck in the kernel (state D: a GPU driver) may hold its GPU: SIGKILLed every second and named in
        ``train.log`` until gone, nothing reported meanwhile (``docs/fencing.md``); another alive after 2 s
        has the pid now (left alone)."""
        tree = [p for p in self.tree if protocol.pid_alive(p)]
        protocol.signal_processes(tree, signal.SIGKILL)
        left, noted = protocol.survivors(tree), None
        found = {p: protocol.proc_stat(p) for p in left}
        stuck = [p for p in left if found[p] is not None and found[p][0] == "D"]
        if others := sorted(set(left) - set(stuck)):
            self._note(f"pid(s) {others} alive after SIGKILL but not stuck in the kernel: another process has "
                       "the pid now (left alone)")
        while stuck:
            if noted is None or time.monotonic() - noted >= STUCK_NOTE_S:
                self._note(f"process(es) {stuck} still alive after SIGKILL (stuck in the kernel): waiting "
                           "for them to be gone before the trainer's GPUs are given up")
                noted = time.monotonic()
            protocol.signal_processes(stuck, signal.SIGKILL)
            stuck = [p for p in protocol.survivors(stuck, timeout_s=1.0)
                     if (now := protocol.proc_stat(p)) is not None and now[1] == found[p][1]]  # not a new pid holder
        self.tree = []

    def _fence(self, reason: str) -> None:
        """Stop the trainer because its lease is stale: SIGTERM now, SIGKILL of every process left
        no later than the lease's ``kill_s`` (the grace period is cut to fit)."""
        periods = self.lease.periods
        assert periods is not None
        grace = periods.kill_s - self.lease.age_s(time.time(), time.monotonic())
        self._note(f"fencing the trainer: {reason}; it must be dead within {max(0.0, grace):.1f}s, "
                   "before the broker may give its GPUs to another job")
        self._stop()  # the grace period cut to the lease's kill_s
        self._mark_fenced(f"fenced: the trainer and its workers are stopped (fence {self.fences + 1})")

    def _mark_fenced(self, note: str) -> None:
        """No trainer runs and none may start until contact is back: state ``fenced`` (one more
        fence unless it already was)."""
        self.proc = None
        if not self.fenced:
            self.fences += 1
            self.fenced = True
            self.fenced_s = time.time()
        self._note(note)
        self._status(protocol.FENCED)

    def run(self) -> int:
        """Run until the trainer exits or is stopped; its exit code (0 when stopped)."""
        signal.signal(signal.SIGTERM, lambda *_: self._terminated.set())
        signal.signal(signal.SIGINT, lambda *_: self._terminated.set())
        echo = _Echo(self.dir / protocol.LOG) if self.echo else None
        if echo is not None:
            threading.Thread(target=echo.follow, daemon=True).start()
        try:
            return self._run()
        finally:
            if echo is not None:
                echo.copy()  # the last lines (a stop's checkpoint, a traceback) before this process ends

    def _run(self) -> int:
        self._status(protocol.STARTING)
        while True:
            if self.proc is not None and self.proc.poll() is not None and not self._peer_stopped_first():
                # first: an exit that happened is reported, even if a new generation, a suspension
                # or a stop came meanwhile (restarting it would hide a success or a failure)
                self._kill_workers()
                code = self.proc.returncode
                self._note(f"trainer exited with code {code}")
                self._status(protocol.EXITED, code)
                return code if code >= 0 else 128 - code
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
            fence = self._check_lease()
            if fence is not None and self.proc is not None and self.proc.poll() is None:
                self._fence(fence)
                continue
            if (self.fenced or self.suspended) and self._abandoned():
                return EXIT_FENCED
            gen = int(desired.get("generation", 0))
            resume = (self.fenced and gen == self.generation
                      and int(desired.get("resume", 0)) >= self.fences)
            if fence is None and gen > self.generation and not desired.get("gpus"):
                # a generation with no GPUs here (the job suspended, or a gang node it does not use):
                # checkpoint, stop, wait for a generation with GPUs
                self._suspend(gen)
                continue
            if fence is None and (gen > self.generation or resume) and desired.get("gpus"):
                if (self.proc is not None and self._stop() is not None) or self.fenced:
                    self.restarts += 1
                if (late := self._check_lease()) is not None:
                    # contact was lost during the stop (a grace period): no new trainer without a lease
                    self._mark_fenced(f"not starting generation {gen}: {late}")
                    continue
                if self.fenced:
                    self._note(f"contact with the broker is back: restarting the fenced trainer "
                               f"on generation {gen}")
                self.generation = gen
                self.fenced = False
                self.suspended = False
                try:
                    self._start(desired)
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
            time.sleep(self.poll_s)

    def _peer_stopped_first(self) -> bool:
        """The trainer exited with a non-zero code as part of a gang (``nnodes`` > 1) because a
        peer node's trainer was stopped first for the gang's next generation: each node's
        launcher (or pod's agent) sees a generation at its own poll, and the peers' processes fail
        when one of them goes (a broken rendezvous, a collective that never completes). True when,
        within ``peer_wait_s`` (or the longer wait the agent's lease names: a gang of pods'
        agents each poll the broker, one up to two polls and three request timeouts after another), a
        newer generation or a stop arrives (or the launcher is stopped)
        while the lease is fresh: the exit is then that stop's, handled as such (the trainer
        restarts from its checkpoint on the new generation). An exit with 0, a single node's
        trainer, or no newer generation in time: False (the exit is reported)."""
        assert self.proc is not None
        if self.proc.returncode == 0 or self.nnodes <= 1:
            return False
        self._kill_workers()
        self._check_lease()  # the agent's latest word on the wait
        deadline = time.monotonic() + max(self.peer_wait_s, self.lease.peer_wait_s)
        while True:
            desired = protocol.read_json(self.dir / protocol.DESIRED) or {}
            if self._terminated.is_set() or desired.get("stop") or int(desired.get("generation", 0)) > self.generation:
                if self._check_lease() is not None:
                    return False
                self._note(f"trainer exited with code {self.proc.returncode} as the gang left generation "
                           f"{self.generation} (a peer node's trainer was stopped first): taken as that stop")
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def _suspend(self, generation: int) -> None:
        """The broker suspended the job (``generation`` has no GPUs): stop the trainer as for a
        resize (SIGTERM, the grace period for its checkpoint, then SIGKILL) and wait, holding no GPU,
        for a generation with GPUs; the agent acks ``generation`` once the status says SUSPENDED."""
        if self.proc is not None and self._stop() is not None:
            self.restarts += 1
        self.proc = None
        self.fenced = False
        self.suspended = True
        self.generation = generation
        self._note(f"suspended on generation {generation} (no GPUs here): the trainer is stopped and "
                   "resumes from its checkpoint when a generation gives GPUs back")
        self._status(protocol.SUSPENDED)

    def _check_lease(self) -> str | None:
        """Read ``lease.json``; why the trainer must not run now, or ``None``."""
        try:
            data = protocol.read_json(self.dir / protocol.LEASE)
        except ValueError:  # malformed: the last good contact keeps ageing
            data = None
        now_s, now_mono = time.time(), time.monotonic()
        self.lease.update(data, now_s, now_mono)
        return self.lease.fence_reason(now_s, now_mono)

    def _abandoned(self) -> bool:
        """Fenced or suspended, and the agent (its pid known) has been gone for a whole lease: by then the
        broker has declared the job lost, so no agent will resume this trainer."""
        periods = self.lease.periods
        gone = self.lease.agent_gone_s(time.monotonic())
        if periods is None or gone < periods.lease_s:
            return False
        self._note(f"the agent (pid {self.lease.agent_pid}) has been gone for {gone:.1f}s after the fence: "
                   f"exiting ({EXIT_FENCED})")
        return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Echo:
    """Copies what is appended to ``path`` to stdout (so container logs show the trainer)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.lock = threading.Lock()

    def copy(self) -> None:
        """Copy what was appended since the last call."""
        with self.lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.pos)
                    chunk = f.read()
                    self.pos = f.tell()
            except FileNotFoundError:
                chunk = b""
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()

    def follow(self, period_s: float = 0.5) -> None:
        while True:
            self.copy()
            time.sleep(period_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared-dir", required=True, type=Path)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--echo", action="store_true", help="copy the trainer's log to stdout")
    parser.add_argument("--peer-wait-s", type=float, default=5.0,
                        help="a gang node's trainer exiting non-zero: how long to wait for the gang's "
                             "next generation (a peer stopped first) before reporting the exit")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no training command given (put it after --)")
    args.shared_dir.mkdir(parents=True, exist_ok=True)
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    return Launcher(
        args.shared_dir, cmd, checkpoint_dir=args.checkpoint_dir,
        grace_s=args.grace_s, poll_s=args.poll_s, echo=args.echo, peer_wait_s=args.peer_wait_s,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
