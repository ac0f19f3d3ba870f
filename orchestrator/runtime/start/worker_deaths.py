"""Which of a node agent's workers a signal ended (SIGKILL from the OOM killer or a user, SIGSEGV), seen the moment
it died — before torch's elastic agent reaps it, stops its other workers and restarts them all.

Its peers only see a broken collective ("Connection reset by peer") and one of them records the attempt's end
(:func:`orchestrator.runtime.faults.lost.crash_cause`); without this, that peer was named as the cause. Each worker
writes its process id (:func:`note_worker`, ``pid_<host>_<pid>`` beside the job file: its rank); :func:`watch` is a thread
in the agent that wakes on any child's exit (``waitid(P_ALL, WEXITED | WNOWAIT)``: a peek, the zombie stays for
torch's ``Popen.poll`` to reap) and reports each worker a signal ended, once. SIGTERM and SIGINT are left out: they
are the stop signals the agent itself, SLURM or a terminal send to every worker. Linux; no torch import.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path
from typing import Callable, Optional

PID_PREFIX = "pid_"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def note_worker(job_file: "str | os.PathLike", rank: int) -> None:
    """A worker of the agent: say which rank this process is (``pid_<host>_<pid>`` beside ``job_file``)."""
    try:
        (Path(job_file).parent / f"{_prefix()}{os.getpid()}").write_text(str(rank))
    except OSError:
        pass


def signal_line(number: int) -> str:
    """``"exit by signal 9, SIGKILL"`` for signal ``number`` (the words of submit.failure_report's local ranks)."""
    try:
        return f"exit by signal {number}, {signal.Signals(number).name}"
    except ValueError:
        return f"exit by signal {number}"


def _prefix() -> str:
    return f"{PID_PREFIX}{socket.gethostname()}_"  # (the folder is shared by the job's nodes: pids repeat)


def _rank_of(job_dir: Path, pid: int) -> Optional[int]:
    try:
        return int((job_dir / f"{_prefix()}{pid}").read_text())
    except (OSError, ValueError):
        return None


def watch(job_dir: Path, on_death: Callable[[int, str], None]) -> threading.Thread:
    """Start the daemon thread that calls ``on_death(rank, "exit by signal 9, SIGKILL")`` for each worker (a child of
    this process that wrote its ``pid_<host>_`` file in ``job_dir``) a signal other than SIGTERM/SIGINT ended. Returns it."""

    def peek_all() -> None:
        seen: set = set()
        while True:
            try:  # blocks until a child has exited; WNOWAIT leaves it for its owner to reap
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # no child yet (or any more)
                threading.Event().wait(0.2)
                continue
            prefix = _prefix()
            for path in job_dir.glob(f"{prefix}*"):
                pid = int(path.name[len(prefix) :]) if path.name[len(prefix) :].isdigit() else 0
                if not pid or pid in seen:
                    continue
                try:
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:  # not ours (another node's worker on a shared folder), or reaped
                    continue
                if info is None:
                    continue
                seen.add(pid)
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) and info.si_status not in STOP_SIGNALS
                rank = _rank_of(job_dir, pid) if killed else None
                if rank is not None:
                    on_death(rank, signal_line(info.si_status))
            threading.Event().wait(0.05)  # the zombie stays until torch's next poll (monitor_interval)

    thread = threading.Thread(target=peek_all, name="worker-deaths", daemon=True)
    thread.start()
    return thread
