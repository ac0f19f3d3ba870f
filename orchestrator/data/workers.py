"""Tokenizing worker processes that a signal to the launcher ends at once, whatever they are doing.

``multiprocessing.Pool`` hung the launcher on Ctrl-C while a JSONL corpus was tokenized (3 of 3): the
KeyboardInterrupt left the Pool's ``with``, whose ``terminate()`` puts a sentinel on the result queue under
the queue's write lock (a semaphore shared by every process) -- which a worker held while it wrote a 1 MB result
into a pipe that the pool's result thread, already told to stop, no longer read. Launcher and workers then
waited on each other forever (a second Ctrl-C got it out).

Here each worker has a pipe pair of its own (:func:`multiprocessing.Pipe`): one writer and one reader per pipe,
no lock shared between processes, no helper thread. The launcher sends a worker its next chunk only once it
has read that worker's last result (one chunk in flight per worker, taken round-robin, so results come back in
order), so neither side ever writes into a pipe the other is not about to read. On any exit of the launcher's
loop -- done, an error, a signal's KeyboardInterrupt -- every worker is sent SIGKILL, which no worker state
(a blocked write, a held lock) can delay, and joined: the join of a killed process returns, so the exit cannot
hang; no worker is left. No torch import.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Iterator, List


def _worker(encode: Callable[[list], list], conn, inherited: list) -> None:
    """One worker's loop: a chunk in, its result out, until the launcher's end of the pipe closes (a launcher
    killed outright included: ``inherited``, the launcher's ends of the pipes forked so far, are closed here, so
    that no worker holds another's pipe open).
    SIGINT ignored (Ctrl-C reaches the whole process group: the launcher alone answers it, exit 130, one
    line); SIGTERM / SIGHUP back to their default (a fork inherits the launcher's handler, which raised
    KeyboardInterrupt in every worker, each printing a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for other in inherited:
        other.close()
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", encode(chunk)))
        except Exception as exc:  # noqa: BLE001 - handed to the launcher, which raises it
            conn.send(("error", RuntimeError(f"tokenizing worker {os.getpid()}: {type(exc).__name__}: {exc}")))


def encoded_in_workers(encode: Callable[[list], list], chunks: Iterator[list], workers: int) -> Iterator[list]:
    """``encode(chunk)`` of each chunk, in order, computed in ``workers`` forked processes (``encode`` is
    inherited by the fork, never pickled). Raises RuntimeError when a worker fails or dies (its exit code)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for _ in range(workers):
            mine, theirs = ctx.Pipe(duplex=True)
            conns.append(mine)
            proc = ctx.Process(target=_worker, args=(encode, theirs, list(conns)), daemon=True)
            procs.append(proc)
            proc.start()
            theirs.close()
        busy = []  # the workers with a chunk in flight, in the order the chunks were sent
        for i, chunk in zip(range(workers), chunks):
            conns[i].send(chunk)
            busy.append(i)
        while busy:
            i = busy.pop(0)
            yield _result(conns[i], procs[i])
            chunk = next(chunks, None)
            if chunk is not None:
                conns[i].send(chunk)
                busy.append(i)
    finally:
        _end(procs, conns)


def _result(conn, proc) -> List:
    try:
        kind, got = conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"tokenizing worker {proc.pid} died (exit code {proc.exitcode})") from None
    if kind == "error":
        raise got
    return got


def _end(procs: list, conns: list) -> None:
    """SIGKILL and join every started worker (see the module docstring: this cannot block)."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join()
    for conn in conns:
        conn.close()
