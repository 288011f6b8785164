"""The shared-directory protocol between the agent and the launcher (standard library only).

Files in the job's shared directory, each replaced atomically (write a temp
file, fsync, ``os.replace``) so a reader never sees half a file:

``desired.json`` (agent -> launcher)
    ``{"generation": int, "gpus": [int, ...], "stop": bool, "resume": int}``: run the
    trainer on these device indices; a higher generation means stop and restart;
    ``stop`` means stop the trainer and exit; ``resume`` (optional) lets a fenced
    launcher restart the trainer on the same generation once ``resume`` is at least its
    ``fences`` count (the agent writes it only after the broker confirmed that the job
    still runs with that generation). A job on several nodes (a gang, one launcher per node, see
    :func:`.gang.gang_plan`) adds ``nnodes``, ``node_rank``, ``master_addr`` and ``master_port``
    (the rendezvous of the generation; the launcher expands :data:`PLACEHOLDERS` with them), and
    a newer generation with no ``gpus`` tells a node's launcher to stop its trainer and wait
    (state ``suspended``: the gang shrank to fewer nodes).
``stop.json`` (agent or backend -> launcher)
    ``{"time_s": float, "why": str}``: stop the trainer and exit, like ``desired.json``'s
    ``stop``, which is also set (for a launcher of an earlier version). It is a file of its own
    because ``desired.json`` has two writers: a stop written there by a backend could be
    overwritten by the agent writing a generation it had just read from the broker (the launcher
    then never saw the stop, and its trainer was SIGKILLed at the stop's timeout, without the
    SIGTERM that lets it checkpoint). Nothing but :func:`.stops.withdraw_stop` removes it.
``status.json`` (launcher -> agent)
    ``{"generation": int, "state": str, "pid": int|null, "exit_code": int|null,
    "restarts": int, "workers": [int, ...], "fences": int, "fenced_s": float|null,
    "time_s": float}``; ``state`` is one of :data:`STATES`; ``fenced_s``: when the
    last fence had stopped the trainer and all its workers (epoch seconds).
``lease.json`` (agent -> launcher)
    the agent's last *confirmed contact* with the broker: ``{"contact_s": float,
    "lease_s": float, "fence_s": float, "kill_s": float, "generation": int,
    "status": str, "agent_pid": int|null[, "peer_wait_s": float]}``. ``contact_s`` is when the agent *sent*
    the last heartbeat the broker answered with a running job (epoch seconds; the
    broker's record of it is later still). Once this file exists the launcher is
    *fenced*: with no confirmed contact for ``fence_s`` it stops the trainer on its
    own (SIGTERM), and SIGKILLs whatever is left at ``kill_s`` (``lease_s`` minus a
    margin), before the broker may declare the job lost and reuse its GPUs. See
    :func:`fence_periods` and ``docs/fencing.md``. ``peer_wait_s`` (a gang of pods' node only): how much later
    than this node a gang's other node may see a generation (two of its agent's polls and
    three request timeouts): the longest a gang node's trainer that failed is given for the next
    generation before its exit is reported (see ``launcher.py``).
``train.log``
    the trainer's stdout and stderr, appended across restarts, with the launcher's own lines
    (:func:`launcher_line`); a line from :func:`generation_line` marks where a generation's
    trainer starts, so the agent can tag each progress line with its generation.

This module is copied next to ``launcher.py`` into images that lack the
package, so it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DESIRED = "desired.json"
STOP = "stop.json"
STATUS = "status.json"
LOG = "train.log"
LEASE = "lease.json"
NODES = "nodes"
"""A gang job's directory holds one launcher directory per node: ``<job dir>/nodes/<node name>/``."""

STARTING, RUNNING, STOPPING, EXITED, STOPPED, FENCED, SUSPENDED = (
    "starting", "running", "stopping", "exited", "stopped", "fenced", "suspended")
STATES = (STARTING, RUNNING, STOPPING, EXITED, STOPPED, FENCED, SUSPENDED)
# SUSPENDED: the broker published a generation with no GPUs (a preemptible job suspended): the
# trainer was stopped with its grace period for a checkpoint and the launcher waits for a generation
# with GPUs, on which it restarts the trainer (which resumes from its checkpoint). A gang node that a
# generation does not use is suspended the same way.
# EXITED: the trainer ended by itself (exit_code says how); STOPPED: stopped on request;
# FENCED: stopped by the launcher itself for lack of contact with the broker (the launcher waits
# for contact to resume, see ``lease.json``).

def exit_code(status: dict[str, Any]) -> int | None:
    """The exit code of an ``exited`` ``status.json``: its ``exit_code`` when that is an integer, else
    ``None`` (missing, ``null``, a string...). A reader must take ``None`` for a failure, never for 0:
    an exit whose code cannot be read is not a success (:func:`clean_exit`)."""
    code = status.get("exit_code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def clean_exit(status: dict[str, Any]) -> bool:
    """True when ``status`` says the trainer exited by itself with code 0."""
    return status.get("state") == EXITED and exit_code(status) == 0


def failed_exit(status: dict[str, Any]) -> bool:
    """True when ``status`` says the trainer exited by itself with a non-zero or unreadable code."""
    return status.get("state") == EXITED and exit_code(status) != 0


PLACEHOLDERS = ("{num_gpus}", "{nnodes}", "{node_rank}", "{master_addr}", "{master_port}")
"""What the launcher replaces in a training command: the node's GPU count, the gang's node count,
this node's rank (0 on a single node), and the rendezvous address and port of the generation."""
GANG_PLACEHOLDERS = PLACEHOLDERS[1:]
"""The placeholders a command must use to run on several nodes (a gang)."""


def expand_command(command: str, desired: dict[str, Any]) -> str:
    """``command`` with :data:`PLACEHOLDERS` replaced from ``desired.json`` (a single-node job:
    ``nnodes`` 1, ``node_rank`` 0, ``master_addr`` 127.0.0.1, ``master_port`` 29500)."""
    values = {
        "{num_gpus}": len(desired.get("gpus") or []), "{nnodes}": desired.get("nnodes", 1),
        "{node_rank}": desired.get("node_rank", 0), "{master_addr}": desired.get("master_addr", "127.0.0.1"),
        "{master_port}": desired.get("master_port", 29500),
    }
    for name, value in values.items():
        command = command.replace(name, str(value))
    return command


@dataclass(frozen=True)
class FencePeriods:
    """How long a trainer may run without a confirmed contact with the broker (seconds).

    ``fence_s``: SIGTERM the trainer (it may checkpoint); ``kill_s``: SIGKILL whatever is left;
    ``lease_s``: the broker's lease, after which it may declare the job lost and reuse its GPUs.
    ``fence_s <= kill_s < lease_s``.
    """

    lease_s: float
    fence_s: float
    kill_s: float


def fence_periods(lease_s: float, fence_s: float | None = None, margin_s: float | None = None) -> FencePeriods:
    """The fence periods for a broker lease of ``lease_s`` seconds.

    :param fence_s: no confirmed contact for this long stops the trainer (default ``lease_s / 2``,
        lowered to ``kill_s`` if the margin leaves less).
    :param margin_s: how long before the lease ends every process of the trainer must be dead:
        covers the launcher's poll period, the kill itself and clock-rate drift (default
        ``max(1, lease_s / 10)``, at most ``lease_s / 2``).
    :raises ValueError: a period that is not a finite number > 0, ``margin_s >= lease_s``, or an
        explicit ``fence_s`` later than ``lease_s - margin_s``.
    """
    for name, value in (("lease_s", lease_s), ("fence_s", fence_s), ("margin_s", margin_s)):
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    margin = min(max(1.0, lease_s / 10), lease_s / 2) if margin_s is None else float(margin_s)
    if margin >= lease_s:
        raise ValueError(f"margin_s={margin:g} must be shorter than the lease ({lease_s:g}s)")
    kill = lease_s - margin
    if fence_s is not None and fence_s > kill:
        raise ValueError(
            f"fence_s={fence_s:g} leaves no time to stop the trainer before the lease ({lease_s:g}s) "
            f"ends: it must be at most lease_s - margin_s = {kill:g}s"
        )
    fence = min(lease_s / 2, kill) if fence_s is None else float(fence_s)
    return FencePeriods(float(lease_s), fence, kill)

_GENERATION_LINE = re.compile(r"^\[launcher [^\]]*\] generation (\d+): starting")
_LAUNCHER_LINE = re.compile(r"^\[launcher [^\]]*\] (.*)$")


def recorded_processes(statuses: Iterable[Mapping[str, Any]]) -> dict[int, int | None]:
    """The trainers and workers that launchers' ``status.json`` files record, pid -> start time
    (:func:`proc_stat`'s; None when not recorded), but none of a launcher whose trainer has
    stopped or exited (its pid is kept in the file, reaped long since: another process may have
    it now). What a stop or a kill of a dead launcher's orphans signals, with those start times."""
    procs: dict[int, int | None] = {}
    for s in statuses:
        if s.get("state") in (STOPPED, EXITED):
            continue
        if s.get("pid"):
            procs[int(s["pid"])] = s.get("pid_start")
        starts = s.get("worker_starts") or []
        for i, pid in enumerate(s.get("workers") or []):
            procs[int(pid)] = starts[i] if i < len(starts) else None
    return procs


def launcher_line(message: str, now: float | None = None) -> str:
    """A line the launcher writes into ``train.log``: ``[launcher HH:MM:SS] message``."""
    return f"[launcher {time.strftime('%H:%M:%S', time.localtime(now))}] {message}\n"


def generation_line(generation: int, detail: str, now: float | None = None) -> str:
    """The ``train.log`` line that marks the start of ``generation``'s trainer."""
    return launcher_line(f"generation {generation}: starting {detail}", now)


EXIT_NOTE = "trainer exited with code {}"
"""The launcher's note (:func:`launcher_line`) that its trainer exited by itself, with its code."""


def launcher_notes(text: str) -> list[str]:
    """The messages of the launcher's lines (:func:`launcher_line`) in ``text``, in order."""
    return [m.group(1) for line in text.splitlines() if (m := _LAUNCHER_LINE.match(line))]


def parse_generation_line(line: str) -> int | None:
    """The generation a :func:`generation_line` marks, or ``None`` for any other line."""
    return int(m.group(1)) if (m := _GENERATION_LINE.match(line)) else None


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (readers see the old or the new file, never a mix)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def stop_requested(directory: str | os.PathLike[str], desired: Mapping[str, Any]) -> bool:
    """True when the launcher of ``directory`` was asked to stop (``stop.json``, or ``desired``'s
    ``stop``)."""
    return bool(desired.get("stop")) or (Path(directory) / STOP).exists()


class LeaseWatch:
    """The launcher's view of ``lease.json``: how long since the agent's last confirmed contact.

    The age of a contact is measured twice and the larger is used: on the wall clock from the
    ``contact_s`` the agent wrote (the agent and the launcher share a host, so a clock offset
    cancels out), and on this process's monotonic clock from when the launcher first saw that
    contact (minus its wall-clock age then), so that the wall clock stepping back cannot postpone
    a fence. A stepping forward only fences early.

    The launcher's watchdog thread reads :meth:`age_s` while its main loop calls :meth:`update`:
    a contact and when it was seen are kept as one tuple, replaced whole (never half new).
    """

    def __init__(self) -> None:
        self.periods: FencePeriods | None = None  # None: no lease yet, fencing not armed
        self._contact: tuple[float, float] | None = None  # (contact_s, seen on the monotonic clock)
        self.agent_pid: int | None = None
        self._agent_gone_mono: float | None = None
        self.peer_wait_s = 0.0  # the agent's: how much later a peer's agent may see a generation

    def update(self, data: dict | None, now_s: float, now_mono: float) -> None:
        """Take in the current ``lease.json`` (``None``: not written yet); a malformed file
        changes nothing (the last good contact keeps ageing)."""
        if data is not None:
            try:
                contact = float(data["contact_s"])
                periods = FencePeriods(float(data["lease_s"]), float(data["fence_s"]),
                                                float(data["kill_s"]))
                agent_pid = int(data["agent_pid"]) if data.get("agent_pid") else None
                peer_wait_s = float(data.get("peer_wait_s") or 0.0)
            except (KeyError, TypeError, ValueError):
                pass
            else:
                if 0.0 <= peer_wait_s < float("inf"):  # NaN or negative: the launcher's own wait
                    self.peer_wait_s = min(peer_wait_s, periods.lease_s)
                if contact != self.contact_s:
                    self._contact = (contact, now_mono - max(0.0, now_s - contact))
                self.periods = periods
                if agent_pid != self.agent_pid:
                    self.agent_pid, self._agent_gone_mono = agent_pid, None
        if self.agent_pid is not None and not pid_alive(self.agent_pid):
            if self._agent_gone_mono is None:
                self._agent_gone_mono = now_mono
        else:
            self._agent_gone_mono = None

    @property
    def contact_s(self) -> float | None:
        """The last confirmed contact (the agent's wall clock, s), ``None`` before the first lease."""
        return None if self._contact is None else self._contact[0]

    def age_s(self, now_s: float, now_mono: float) -> float:
        """Seconds since the last confirmed contact (0 when fencing is not armed)."""
        if (contact := self._contact) is None:
            return 0.0
        return max(now_s - contact[0], now_mono - contact[1])

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


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in ``path``, or ``None`` if the file does not exist yet."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from the third (the state letter) on: read after the
    command name, which may hold ``)`` and spaces, and is not text: the kernel cuts it to 15
    bytes, through a UTF-8 character if it must (read as text, such a process seemed gone).

    :raises FileNotFoundError: no such process (or no ``/proc``).
    :raises OSError, IndexError: unreadable.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].decode("ascii", "replace").split()


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (reads ``/proc`` where there is one).

    A zombie thread-group leader with a thread still running is alive: a multithreaded process
    (a CUDA worker) whose main thread has exited while another still tears its device down holds
    the GPU until that thread is gone too."""
    try:
        return _stat_fields(pid)[0] != "Z" or _a_thread_runs(pid)
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
    except (IndexError, OSError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _a_thread_runs(pid: int) -> bool:
    """Whether a thread of process ``pid`` (its ``/proc/<pid>/task`` entries) is not a zombie."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            if _stat_fields(f"{pid}/task/{tid}")[0] != "Z":
                return True
        except (OSError, IndexError):
            continue
    return False


def same_process(pid: int, start: int | None) -> bool:
    """True while process ``pid`` is alive and is the one that started at ``start`` (clock ticks
    since boot, :func:`proc_stat`'s): a process started at another time has the pid now (the
    recorded one ended and the pid was reused). ``start`` None, or no ``/proc`` to tell: alive is
    enough."""
    return not _taken(pid, start) and pid_alive(pid)


def _taken(pid: int, start: int | None) -> bool:
    """Whether another process than the one recorded to start at ``start`` has ``pid`` now."""
    return start is not None and (now := proc_stat(pid)) is not None and now[1] != start


def proc_stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (``R``, ``S``, ``D``: uninterruptible sleep, ``Z``...) and start
    time in clock ticks since boot (fields 3 and 22 of ``/proc/<pid>/stat``); None where unknown (no
    ``/proc``, or the process is gone). The start time tells a process from a later one given its pid."""
    try:
        fields = _stat_fields(pid)
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def become_subreaper() -> bool:
    """Adopt orphans of descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a process leaving the trainer's tree
    (a double fork, a worker whose parent died) stays below the launcher, not init. False where it cannot."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # 36: PR_SET_CHILD_SUBREAPER
    except (ImportError, OSError, AttributeError):  # not Linux, or a Python built without ctypes
        return False


def process_tree(root: int, known: Mapping[int, int | None]) -> dict[int, int | None]:
    """The processes below ``root`` now (:func:`descendants`), each with its start time
    (:func:`proc_stat`; None where unknown), and those of ``known`` (pid: start time) that are
    still the same live process (:func:`same_process`): a worker that was re-parented when the
    process between it and ``root`` died is no longer below ``root`` and still runs on the
    trainer's GPUs; one that has ended is dropped, and so its pid is never signalled once another
    process has it."""
    found: dict[int, int | None] = {}
    for pid in descendants(root):
        if (stat := proc_stat(pid)) is not None:  # None: it has just ended (its pid may go to anyone)
            found[pid] = stat[1]
    return {**{p: s for p, s in known.items() if p not in found and same_process(p, s)}, **found}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...), from ``/proc``; empty where there is none.

    Needed because launchers such as ``torchrun`` start each worker in its own session: signalling
    the trainer's process group does not reach them, and once their parent dies they are
    re-parented and can no longer be found this way. Call it while the parent lives.
    """
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(entry)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


BROKER_HEADER = "x-elastic-gpu-broker"
"""On every answer of the broker's API; :data:`JOB_ANSWER_HEADER` on its 401/403/404 about the job
itself (its token, its end, its absence). The agent takes such an answer for "the job ended" only
with both: not a proxy's 404 while the API restarts, nor the broker's for a path it does not serve
(an API URL one level too deep, ``.../api/v1``), either of which stopped a live trainer."""
JOB_ANSWER_HEADER = "x-elastic-gpu-job-answer"

KILL_WAIT_S = 2.0
"""How long a SIGKILLed process is waited for (it vanishes within milliseconds unless stuck in the kernel)."""


def survivors(pids: list[int], timeout_s: float = KILL_WAIT_S, starts: Mapping[int, int | None] | None = None,
              ) -> list[int]:
    """Wait up to ``timeout_s`` for the processes ``pids`` (just SIGKILLed) to be gone; those still alive.

    :param starts: each pid's start time when it was recorded (:func:`same_process`): a pid
        another process has now counts as gone."""
    starts = starts or {}
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if same_process(p, starts.get(p))]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def may_signal(pid: int) -> bool:
    """False when process ``pid`` exists and this process may not signal it (EPERM: another user's,
    a setuid program)."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return False
    except OSError:
        pass
    return True


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pid``, if it still exists."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_processes(pids: list[int], sig: int, starts: Mapping[int, int | None] | None = None) -> None:
    """Send ``sig`` to each pid's process group and to the pid itself; gone ones are skipped.

    :param starts: each pid's start time when it was recorded (:func:`proc_stat`): a pid that
        another process has now (started at another time) is left alone, its group too. A
        recorded pid that is gone still has its group signalled (its workers may live on in it)."""
    starts = starts or {}
    for pid in pids:
        if _taken(pid, starts.get(pid)):
            continue
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, sig)
            except (ProcessLookupError, PermissionError, OSError):
                pass
