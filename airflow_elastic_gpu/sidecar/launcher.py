"""Launcher: runs the training command on the GPUs in ``desired.json`` and restarts it on a new generation.

It is the entry point of the training container (or process, locally), so it
uses only the standard library; copy ``launcher.py`` and ``protocol.py`` into any
image. Usage: ``python launcher.py --shared-dir DIR [--checkpoint-dir DIR] [--grace-s 30] -- CMD ...``.
``CMD`` is split like a shell would (``shlex``) after ``{num_gpus}`` is replaced by the generation's GPU
count on this node (and, for a job on several nodes, ``{nnodes}``, ``{node_rank}``, ``{master_addr}`` and
``{master_port}``, see :data:`protocol.PLACEHOLDERS`). The trainer gets ``CUDA_VISIBLE_DEVICES``,
``ELASTIC_GPU_COUNT``, ``ELASTIC_GENERATION``, ``ELASTIC_NNODES``, ``ELASTIC_NODE_RANK`` and
``ELASTIC_CHECKPOINT_DIR``; it runs in its own process group, and the launcher is the subreaper of its
processes, so that stopping it (SIGTERM, then SIGKILL after ``--grace-s`` seconds) reaches every worker
``torchrun`` started and every process that left its tree. The launcher exits with the trainer's exit code
when it ends by itself, 0 after a requested stop, 127 if the command is not found, 126 if it cannot run. A trainer that is one node of a gang (``nnodes`` > 1) and exits non-zero is given ``--peer-wait-s``
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
has been gone for a whole lease after a fence (the job is lost by then). A watchdog thread SIGKILLs the
trainer at ``kill_s`` when the launcher's own loop is blocked (a hung shared directory).
"""

from __future__ import annotations

import argparse
import contextlib
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

EXIT_NOT_FOUND = 127  # the shell's: the command was not found
EXIT_CANNOT_RUN = 126  # the shell's: found, but it could not be run (not executable, no shebang, bad quoting)
EXIT_FENCED = 75  # EX_TEMPFAIL: fenced, and no agent came back to resume the trainer
STUCK_NOTE_S = 60.0  # how often a process that survives SIGKILL is named again in train.log


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
        self.starts: dict[int, int | None] = {}  # their start times: a pid reused since is never signalled
        self.proc_start: int | None = None  # the trainer's
        self.lease = protocol.LeaseWatch()
        self.fences = 0  # how many times the trainer was fenced
        self.fenced = False  # the trainer was fenced and has not been restarted since
        self.fenced_s: float | None = None
        self._terminated = threading.Event()
        self.watchdog_killed: subprocess.Popen[bytes] | None = None  # the trainer the watchdog SIGKILLed
        self.subreaper = False  # every process below this launcher is the trainer's (run(): its subreaper)

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
                "pid_start": self.proc_start if self.proc else None,
                "workers": self.tree,
                "worker_starts": [self.starts.get(p) for p in self.tree],
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
            CUDA_DEVICE_ORDER="PCI_BUS_ID",  # the broker's indices are nvidia-smi's (CUDA's default: fastest first)
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
        stat = protocol.proc_stat(self.proc.pid)
        self.proc_start = None if stat is None else stat[1]

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
        self._track(proc.pid)  # workers in sessions of their own too
        tree = list(self.tree)
        protocol.signal_group(proc.pid, signal.SIGTERM)
        # a trainer stopped by a job-control signal or a debugger would sleep through its grace period
        protocol.signal_group(proc.pid, signal.SIGCONT)
        protocol.signal_processes(tree, signal.SIGCONT, self.starts)
        deadline = time.monotonic() + grace_s
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._note("grace period over: SIGKILL")
            protocol.signal_group(proc.pid, signal.SIGKILL)
            protocol.signal_processes(tree, signal.SIGKILL, self.starts)
            proc.wait()
        # workers may still be writing their checkpoint: give them the rest of the grace period
        while any(protocol.same_process(p, self.starts.get(p)) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        protocol.signal_group(proc.pid, signal.SIGKILL)  # stray workers of the group
        self.tree = tree
        self._kill_workers()
        return proc.returncode

    def _kill_workers(self) -> None:
        """SIGKILL the trainer's workers still alive (the trainer has ended; with the subreaper, all below the
        launcher), wait for them to be gone, forget them. One alive after SIGKILL may hold its GPU: stuck in the
        kernel (state D: a GPU driver) or its threads still exiting; it is SIGKILLed every second and named in
        ``train.log`` until gone, nothing reported meanwhile (``docs/fencing.md``). Another alive after 2 s has the
        pid now, as does one started at another time than recorded (both left alone)."""
        if self.subreaper:  # else no root: the ended trainer's pid may be anyone's
            self._track(None)
        starts = self.starts
        tree = [p for p in self.tree if protocol.same_process(p, starts.get(p))]
        protocol.signal_processes(tree, signal.SIGKILL, starts)
        left, noted = protocol.survivors(tree, starts=starts), None
        found = {p: protocol.proc_stat(p) for p in left}
        stuck = [p for p in left if found[p] is not None and (starts.get(p) is not None or found[p][0] == "D")]
        if others := sorted(set(left) - set(stuck)):
            self._note(f"pid(s) {others} alive after SIGKILL but not stuck in the kernel: another process has "
                       "the pid now (left alone)")
        while stuck:
            if unkillable := [p for p in stuck if not protocol.may_signal(p)]:
                # SIGKILL does not reach it (a setuid helper: EPERM), so no wait ends it; its GPUs go
                # back with the lease, as after a fence
                self._note(f"process(es) {unkillable} alive after SIGKILL: they cannot be signalled (another "
                           "user's); left alone")
                stuck = [p for p in stuck if p not in unkillable]
                continue
            if noted is None or time.monotonic() - noted >= STUCK_NOTE_S:
                self._note(f"process(es) {stuck} still alive after SIGKILL (stuck in the kernel): waiting "
                           "for them to be gone before the trainer's GPUs are given up")
                noted = time.monotonic()
            protocol.signal_processes(stuck, signal.SIGKILL)
            stuck = [p for p in protocol.survivors(stuck, timeout_s=1.0)
                     if (now := protocol.proc_stat(p)) is not None and now[1] == found[p][1]]  # not a new pid holder
        self.tree, self.starts = [], {}

    def _track(self, root: int | None) -> bool:
        """Take in the processes below the trainer ``root``, or below this launcher as their subreaper (a double
        fork, a dead parent's worker: :func:`protocol.become_subreaper`); reap adopted ones ended. True on a change."""
        own = {p.pid for p in (self.proc, self.watchdog_killed) if p is not None and p.returncode is None}  # Popen's
        found = {p: t for p, t in protocol.process_tree(os.getpid() if self.subreaper else root, {
            p: self.starts.get(p) for p in self.tree}).items() if p not in own}
        for pid in [p for p in found if (protocol.proc_stat(p) or ("",))[0] == "Z"]:
            with contextlib.suppress(ChildProcessError):  # not this launcher's child (yet)
                os.waitpid(pid, os.WNOHANG)
        changed, self.tree, self.starts = sorted(found) != self.tree, sorted(found), found
        return changed

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
        """Run until the trainer exits or is stopped; its exit code (0 when stopped). The process's entry."""
        self.subreaper = protocol.become_subreaper() or os.getpid() == 1  # PID 1 (a pod's) adopts them anyway
        for sig in (signal.SIGTERM, signal.SIGINT):  # set from a thread: see agent_cli.on_signal
            signal.signal(sig, lambda *_: threading.Thread(target=self._terminated.set, daemon=True).start())
        echo = _Echo(self.dir / protocol.LOG) if self.echo else None
        if echo is not None:
            threading.Thread(target=echo.follow, daemon=True).start()
        threading.Thread(target=self._watchdog, daemon=True, name="fence-watchdog").start()
        try:
            return self._run()
        except BaseException:
            self._kill_all()
            raise
        finally:
            if echo is not None:
                echo.copy()  # the last lines (a stop's checkpoint, a traceback) before this process ends

    def _run(self) -> int:
        self._status(protocol.STARTING)
        while True:
            if (self.proc is not None and self.proc.poll() is not None and self.proc is self.watchdog_killed
                    and self.proc.returncode == -signal.SIGKILL):  # not an exit of its own just before
                self._kill_workers()
                self._mark_fenced("fenced by the watchdog: this launcher's loop was blocked (a hung shared "
                                  "directory?) past the lease's kill deadline, so the trainer and its workers "
                                  f"were SIGKILLed (fence {self.fences + 1})")
                continue
            if self.proc is not None and self.proc.poll() is not None and not self._peer_stopped_first():
                # first: an exit that happened is reported, even if a new generation, a suspension
                # or a stop came meanwhile (restarting it would hide a success or a failure)
                self._kill_workers()
                code = self.proc.returncode
                self._note(protocol.EXIT_NOTE.format(code))
                self._status(protocol.EXITED, code)
                return code if code >= 0 else 128 - code
            if self._terminated.is_set():
                self._stop()
                self._status(protocol.STOPPED)
                return 0
            desired = protocol.read_json(self.dir / protocol.DESIRED) or {}
            if protocol.stop_requested(self.dir, desired):
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
                self.proc = None  # stopped: not an exit to report
                if (late := self._check_lease()) is not None:
                    # contact was lost during the stop (a grace period): no new trainer without a lease
                    self._mark_fenced(f"not starting generation {gen}: {late}")
                    continue
                if self._moved_on(gen):
                    continue  # a stop or a newer generation came during the grace period: that first
                if self.fenced:
                    self._note(f"contact with the broker is back: restarting the fenced trainer on generation {gen}")
                self.generation = gen
                self.fenced = False
                self.suspended = False
                try:
                    self._start(desired)
                except (OSError, ValueError) as exc:  # also: no shebang, unbalanced quotes, a bad ELASTIC_WORKDIR
                    not_found = isinstance(exc, FileNotFoundError) and exc.filename != os.environ.get("ELASTIC_WORKDIR")
                    code = EXIT_NOT_FOUND if not_found else EXIT_CANNOT_RUN  # a missing work dir: 126
                    why = "command not found" if code == EXIT_NOT_FOUND else type(exc).__name__
                    self._note(f"the trainer could not be started ({why}): {exc}")
                    self._status(protocol.EXITED, code)
                    return code
                self._status(protocol.RUNNING)
            if self.proc is not None and self.proc.poll() is None and self._track(self.proc.pid):
                self._status(protocol.RUNNING)  # kept in status.json so a stop from outside finds them
            time.sleep(self.poll_s)

    def _watchdog(self) -> None:
        """Thread: the fence's deadline, kept without the shared directory. The main loop reads the
        lease and writes the status there; when that blocks (a hung network file system), the lease
        it read last keeps ageing here, and once it is ``kill_s`` old the trainer's group and its
        recorded workers are SIGKILLed (every ``poll_s`` while it lasts), as the fence would have:
        signals and ``/proc`` only, no file. The main loop, unblocked, takes that trainer's end for
        a fence, not for its exit."""
        while True:
            time.sleep(self.poll_s)
            proc, periods = self.proc, self.lease.periods
            if proc is None or proc.returncode is not None or periods is None:
                continue
            if self.lease.age_s(time.time(), time.monotonic()) < periods.kill_s:
                continue
            tree, starts = list(self.tree), dict(self.starts)
            if protocol.same_process(proc.pid, self.proc_start):  # alive (not a zombie): still its group
                self.watchdog_killed = proc  # before the kill: the main loop sees no end it has not marked
                protocol.signal_group(proc.pid, signal.SIGKILL)
            protocol.signal_processes(tree, signal.SIGKILL, starts)

    def _kill_all(self) -> None:
        """The launcher dies of an error (a full disk or an unreadable file in the shared
        directory): SIGKILL the trainer's group and its workers first, writing no file (the error
        may be the disk's), so that no trainer outlives the launcher that would fence it."""
        if self.proc is not None and self.proc.poll() is None:  # not reaped: the pid is still the trainer's
            self._track(self.proc.pid)
            protocol.signal_group(self.proc.pid, signal.SIGKILL)
        protocol.signal_processes(self.tree, signal.SIGKILL, self.starts)

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
            if self._moved_on(self.generation):
                if self._check_lease() is not None:
                    return False
                self._note(f"trainer exited with code {self.proc.returncode} as the gang left generation "
                           f"{self.generation} (a peer node's trainer was stopped first): taken as that stop")
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def _moved_on(self, generation: int) -> bool:
        """Told to stop (SIGTERM, ``stop.json``), or given a generation newer than ``generation``."""
        desired = protocol.read_json(self.dir / protocol.DESIRED) or {}
        return self._terminated.is_set() or protocol.stop_requested(self.dir, desired) or int(desired.get("generation", 0)) > generation

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
    for flag, kind, default in (("--checkpoint-dir", Path, None), ("--grace-s", float, 30.0), ("--poll-s", float, 0.2),
                                ("--peer-wait-s", float, 5.0)):  # --peer-wait-s: see the module docstring
        parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--shared-dir", required=True, type=Path)
    parser.add_argument("--echo", action="store_true", help="copy the trainer's log to stdout")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no training command given (put it after --)")
    args.shared_dir.mkdir(parents=True, exist_ok=True)
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    return Launcher(args.shared_dir, cmd, checkpoint_dir=args.checkpoint_dir, grace_s=args.grace_s,
                    poll_s=args.poll_s, echo=args.echo, peer_wait_s=args.peer_wait_s).run()


if __name__ == "__main__":
    sys.exit(main())
