"""A rank its agent stops after a peer's death while it is blocked: record the failure and go now.

Under torch elastic's agents (``cluster.max_restarts`` > 0) a worker's death makes its agent stop the node's other
workers (SIGTERM, then SIGKILL 30 s later: torch 2.13's ``LocalElasticAgent._stop_workers``), and the other nodes'
agents stop theirs the same way once the node re-enters the rendezvous. A survivor normally fails first, its
collective broken ("Connection reset by peer"), and records the attempt's end. A survivor blocked where no error
comes does neither: a collective whose dead peer's sockets live on in another process (megatron's checkpoint
writer, forked from the rank, holds copies of them until it dies too), or any wait without a timeout. Python runs
signal handlers in the main thread only, which is inside C++: the SIGTERM waits. Seen in ``bench/goodput.py``
(every 7 iterations, T = 60 s): a rank killed during a save, 65 s (two agents' 30 s) from the kill to the restart,
and no rank recorded the failure.

So the rank's SIGTERM also reaches a thread: ``signal.set_wakeup_fd`` makes Python's C-level handler write the
signal's number to a pipe at once, whatever the main thread is doing. When a SIGTERM came, a peer's death has
been recorded since this start (:data:`~orchestrator.ckpt.history.SIGNALLED_EVENT`, by its node's agent), and the
main thread has not ended the attempt :data:`GRACE_S` later, the thread ends it as a crash would (the claim,
``attempt_ended`` led by the rank that died, the decision to restart) and exits the process. A SIGTERM without a
recorded death (a preemption, ``scancel``, a stop) is left to the stop handler
(:mod:`~orchestrator.runtime.faults.preempt`): save and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

GRACE_S = 3.0
"""Seconds a SIGTERM after a peer's death leaves the main thread to end the attempt itself (a survivor whose
collective broke records its crash within a second)."""


def watch(ended: Callable[[], bool], peer_died: Callable[[], bool], end: Callable[[], None]) -> bool:
    """Start the thread: on SIGTERM, when ``ended()`` stays False for :data:`GRACE_S` and ``peer_died()``, call
    ``end()`` (it records the failure and the decision) and exit the process (``end``'s ``SystemExit`` code, else
    1). Call from the main thread (``signal.set_wakeup_fd``'s rule), with a Python handler for SIGTERM installed
    before the signal comes. False, and nothing started, elsewhere or when a wakeup fd is set already."""
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:  # someone else's (or none could be set): theirs stays
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    args = (read_fd, ended, peer_died, end)
    threading.Thread(target=_run, args=args, name="orchestrator-agent-stop", daemon=True).start()
    return True


def _run(read_fd: int, ended: Callable[[], bool], peer_died: Callable[[], bool], end: Callable[[], None]) -> None:
    while True:
        try:
            got = os.read(read_fd, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGTERM not in got:  # the signals' numbers, one byte each
            continue
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not ended():
            time.sleep(0.1)
        if ended() or not peer_died():
            continue
        _end_now(end)


def _end_now(end: Callable[[], None]) -> None:
    code = 1
    try:
        end()
    except SystemExit as exc:  # leaving requeued: its code
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the records are best effort; the process goes either way
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
