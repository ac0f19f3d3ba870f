"""The run's attempt history: ``<run_dir>/jobs.jsonl``, one JSON object per line (writing and reading the
records; their fold into attempts is :mod:`orchestrator.ckpt.attempts`).

Who writes what:

* the launcher: each submission (:func:`record_submission`: job id, cluster, log paths, submitit
  folder, number of tasks), and the end of an attempt the job could not record itself (ranks
  killed, node lost, Ctrl-C: :func:`record_attempt_ended` after :func:`claim_attempt_end`);
* the job: ``attempt_started`` (rank 0, when training starts: job id, attempt, host, iteration),
  ``attempt_ended`` (whoever ends the attempt: rank 0 at completion or after a time-limit stop,
  the rank that detects a hang or a crash, every rank alike for a NaN: cause, iteration reached,
  one-line message, whether it was requeued; after a hang or a crash the ``requeue_decision``
  follows the end, which counts against ``cluster.max_failures``) and events (``requeued``,
  ``stopped``, ``hang``, ``nan`` …).

An *attempt* is one run of one job: ``(job_id, attempt)`` where ``attempt`` is SLURM's restart
count (0 for the first run, and always 0 locally). :func:`orchestrator.ckpt.attempts.attempts` folds the
records into one :class:`orchestrator.ckpt.attempts.Attempt` per run — what ``python -m orchestrator status
--history`` prints and what each checkpoint manifest copies (``history``). Exactly one ``attempt_ended`` is
written per attempt: writers first :func:`claim_attempt_end` (an ``O_EXCL`` marker file, safe across processes
and nodes of a shared filesystem); the loser of the race writes nothing.

Appends go through :func:`orchestrator.io.append_jsonl` (locked, whole lines). No torch import.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from orchestrator.ckpt.rundir import HEARTBEAT_DIR, JOBS_FILE
from orchestrator.io import append_jsonl, read_jsonl

PathLike = Union[str, Path]

CAUSES = (
    "completed",
    "exited",
    "timeout",
    "preempted",
    "node failure",
    "hang",
    "nan",
    "spike",
    "crashed",
    "disk full",
    "interrupted",
    "by request",
)
"""Why an attempt ended. ``exited``: ``training.exit_after_iters`` (on purpose, a checkpoint saved); ``disk
full``: ENOSPC in a save or a write (never retried: it would recur); ``by request``: ``orchestrator stop``
(:mod:`orchestrator.ckpt.stop`)."""
TIMEOUT_CAUSES = frozenset({"timeout", "preempted"})
"""Counted against ``cluster.max_num_timeout``."""
FAILURE_CAUSES = frozenset({"hang", "node failure", "crashed"})
"""Counted against ``cluster.max_failures`` (a NaN is not retried: it would recur)."""
SIGNALLED_EVENT = "rank_signalled"
"""A rank a signal ended, recorded by its node's agent the moment it died (``rank``, ``host``, ``how``): the cause
its peers' broken collectives only follow, and the start of a failure even when no rank lives to record the
attempt's end."""


def record_submission(
    run_dir: PathLike, job_id: str, cluster: Any, log_paths: Optional[Dict[str, str]] = None, **extra: Any
) -> Dict[str, Any]:
    """Record a submission in ``<run_dir>/jobs.jsonl`` and return the record.

    ``cluster``: the cluster kind (``"slurm"``/``"local"``) or a ClusterConfig (kind and name are
    taken from it). ``log_paths``: e.g. ``{"stdout": ..., "stderr": ...}`` of rank 0 (submitit's
    ``job.paths``); the submitit folder is derived from them unless ``folder=`` is given.
    Useful extras: ``num_tasks``, ``folder``, ``command``, ``script`` (sbatch file path).
    """
    if isinstance(cluster, str):
        kind, name = cluster, cluster
    else:
        kind, name = getattr(cluster, "kind", str(cluster)), getattr(cluster, "name", str(cluster))
    logs = {k: str(v) for k, v in (log_paths or {}).items()}
    record: Dict[str, Any] = {
        "event": "submitted",
        "time": time.time(),
        "job_id": str(job_id),
        "cluster": kind,
        "cluster_name": name,
        "run_dir": str(Path(run_dir).absolute()),
        "logs": logs,
    }
    if "folder" not in extra and logs:
        extra["folder"] = str(Path(next(iter(logs.values()))).parent)
    record.update({k: (str(v) if isinstance(v, Path) else v) for k, v in extra.items()})
    return append_jsonl(Path(run_dir) / JOBS_FILE, record)


def record_event(run_dir: PathLike, event: str, **fields: Any) -> Dict[str, Any]:
    """Record a job event (``requeued``, ``stopped``, ``cancelled``, ...) in ``<run_dir>/jobs.jsonl``."""
    record = {"event": event, "time": time.time(), **fields}
    return append_jsonl(Path(run_dir) / JOBS_FILE, record)


def record_requeue_decision(run_dir: PathLike, job_id: str, attempt: int, requeued: bool, detail: str) -> None:
    """``requeue_decision`` after a failure's end: whether the job was requeued, and the line saying why (the record
    the ranks that did not claim the end wait for: ``runtime.faults.inplace.await_decision``)."""
    record_event(run_dir, "requeue_decision", job_id=job_id, attempt=attempt, requeued=requeued, detail=detail)


def read_records(run_dir: PathLike) -> List[Dict[str, Any]]:
    """All records of ``<run_dir>/jobs.jsonl`` (malformed lines skipped)."""
    return read_jsonl(Path(run_dir) / JOBS_FILE)


# ---- attempt starts and ends ---------------------------------------------------------------------


def record_attempt_started(
    run_dir: PathLike,
    job_id: str,
    attempt: int,
    *,
    iteration: Optional[int] = None,
    host: Optional[str] = None,
    **fields: Any,
) -> Dict[str, Any]:
    """``attempt_started``: training of attempt ``attempt`` of ``job_id`` begins (at ``iteration``)."""
    return record_event(
        run_dir, "attempt_started", job_id=str(job_id), attempt=int(attempt), iteration=iteration, host=host, **fields
    )


def record_attempt_ended(
    run_dir: PathLike,
    job_id: str,
    attempt: int,
    cause: str,
    *,
    iteration: Optional[int] = None,
    message: str = "",
    **fields: Any,
) -> Dict[str, Any]:
    """``attempt_ended`` with ``cause`` (one of :data:`CAUSES`), the iteration reached and a one-line
    ``message``. Call after winning :func:`claim_attempt_end` so each attempt ends once."""
    if cause not in CAUSES:
        raise ValueError(f"unknown cause {cause!r}; one of {CAUSES}")
    return record_event(
        run_dir,
        "attempt_ended",
        job_id=str(job_id),
        attempt=int(attempt),
        cause=cause,
        iteration=iteration,
        message=message,
        **fields,
    )


def _marker(run_dir: PathLike, job_id: str, attempt: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(job_id))
    return Path(run_dir) / HEARTBEAT_DIR / f"ended_{safe}_{int(attempt)}"


def claim_attempt_end(run_dir: PathLike, job_id: str, attempt: int) -> bool:
    """True for exactly one caller per ``(job_id, attempt)``: the one that records how it ended.

    An ``O_EXCL`` marker in ``<run_dir>/heartbeat/``; when the directory cannot be written (a full
    disk) every caller is told True, so the end is still recorded if the record fits.
    """
    path = _marker(run_dir, job_id, attempt)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def clear_attempt_markers(run_dir: PathLike, job_id: str, attempt: int) -> None:
    """Remove markers a finished job with the same id left (a recycled local process id); called by
    the job's rank 0 when the attempt starts, before any rank can end it."""
    from contextlib import suppress

    with suppress(OSError):
        _marker(run_dir, job_id, attempt).unlink()


def attempt_claimed(run_dir: PathLike, job_id: str, attempt: int) -> bool:
    """Whether someone already claimed the end of this attempt."""
    return _marker(run_dir, job_id, attempt).exists()
