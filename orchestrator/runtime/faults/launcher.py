"""A waited local job ends with its launcher: :func:`watch_launcher`.

A local job's processes are not the launcher's session: submitit's LocalExecutor starts a controller
(``python -m submitit.local._local``), which starts the task(s); a CPU job's one task forks the other
ranks (they die with it, ``PR_SET_PDEATHSIG``), and each rank forks megatron's checkpoint-writer
Manager (which dies with its rank). When the launcher that waits on the job is killed (``kill -9``, a
closed SSH session's SIGKILL, the OOM killer), nothing of that reached the job: it trained on, holding
the run lock and its memory, with nobody reading its results.

So the launcher passes its identity (:func:`launcher_identity`: host, pid and process start time) to
the job when it waits on it (``cluster.wait=true``), and every local task polls it from a daemon thread
every :data:`POLL_S`. Once the launcher is gone (or a zombie), the task asks for the graceful stop of
:mod:`orchestrator.runtime.faults.preempt` (:func:`~orchestrator.runtime.faults.preempt.request_stop`):
the next iteration boundary saves a checkpoint on every rank and the job exits, recording the attempt's
end as ``interrupted`` ("the launcher ... died"); a rerun of the same command resumes from that save.
A job that has not ended :data:`GRACE_S` later (still starting up, stuck, or a save longer than that)
ends now (``os._exit``): its forked ranks and writers die with it, a torn save has no manifest and is
skipped on resume, and the run lock it leaves names a dead process (a stale lock, broken by the next run).

A detached job (``cluster.wait=false``) gets no identity and runs on by design; SLURM jobs never watch.

Every job's rank 0 (local or SLURM, waited on or detached) also watches for a stop asked of it
(:func:`watch_stop`: ``<run.dir>/stop.json``, :mod:`orchestrator.ckpt.stop`, one ``stat`` a second on one
process): ``orchestrator stop RUN``, or a signal to the launcher waiting on a local job. It asks the
same graceful stop, with the request's cause (``by request``, ``interrupted``): never requeued.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

POLL_S = 1.0
"""How often a task checks that its launcher is alive."""
GRACE_S = 30.0
"""How long after the launcher's death a task may take to save and exit before it is ended."""


def launcher_identity() -> Dict[str, Any]:
    """This process as a job (or a warm pool) it launches knows it: ``{"host", "pid", "pid_created"}``
    (the start time: a pid alone may have been reused)."""
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_created": psutil.Process().create_time()}


def launcher_alive(owner: Dict[str, Any]) -> bool:
    """False only when the launcher ran on this host and its process is gone, or a zombie (a killed
    launcher stays one until its own parent reaps it)."""
    if owner.get("host") != socket.gethostname():
        return True
    import psutil

    try:
        process = psutil.Process(int(owner["pid"]))
        return process.create_time() <= float(owner["pid_created"]) + 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def watch_launcher(
    owner: Optional[Dict[str, Any]],
    on_gone: Callable[[str], None],
    *,
    poll_s: float = POLL_S,
    grace_s: float = GRACE_S,
    exit: Callable[[int], None] = os._exit,
) -> Optional[threading.Thread]:
    """Start the daemon thread that watches the launcher ``owner`` (:func:`launcher_identity`): once it
    is gone, ``on_gone(reason)`` (the graceful stop), then ``exit(code)`` after ``grace_s`` if this
    process still runs. No owner (a detached or SLURM job): nothing is watched, None."""
    if not owner:
        return None

    def _watch() -> None:
        while launcher_alive(owner):
            time.sleep(poll_s)
        reason = f"the launcher (pid {owner.get('pid')}) died"
        print(
            f"[orchestrator] {reason}: stopping the job at the iteration its ranks agree on (saving a checkpoint first); "
            f"it is ended in {grace_s:.0f} s otherwise",
            file=sys.stderr,
            flush=True,
        )
        on_gone(reason)
        time.sleep(grace_s)
        print(
            f"[orchestrator] {reason} and the job did not stop within {grace_s:.0f} s: ending it",
            file=sys.stderr,
            flush=True,
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        from orchestrator.runtime.faults.requeue import STOP_EXIT_CODE

        exit(STOP_EXIT_CODE)

    thread = threading.Thread(target=_watch, name="orchestrator-launcher-watch", daemon=True)
    thread.start()
    return thread


def watch_stop(
    run_dir: str, job_id: str, on_request: Callable[[str, str], None], *, poll_s: float = POLL_S
) -> threading.Thread:
    """Start the daemon thread that polls ``<run_dir>/stop.json`` every ``poll_s`` and, once it asks job
    ``job_id`` to stop, calls ``on_request(who asked, cause)`` (the graceful stop) and ends."""
    from orchestrator.ckpt import stop

    path = stop.stop_path(run_dir)

    def _watch() -> None:
        while True:
            asked = stop.read(run_dir, job_id) if path.exists() else None
            if asked is not None:
                who = str(asked.get("by") or "a stop request")
                print(
                    f"[orchestrator] stop asked by {who}: stopping at the iteration the ranks agree on (saving a checkpoint first)",
                    file=sys.stderr,
                    flush=True,
                )
                on_request(who, str(asked.get("cause") or stop.BY_REQUEST))
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=_watch, name="orchestrator-stop-watch", daemon=True)
    thread.start()
    return thread
