"""The run's attempt history: ``<run_dir>/jobs.jsonl``, one JSON object per line.

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
count (0 for the first run, and always 0 locally). :func:`attempts` folds the records into one
:class:`Attempt` per run — what ``python -m orchestrator status --history`` prints and what each
checkpoint manifest copies (``history``). Exactly one ``attempt_ended`` is written per attempt:
writers first :func:`claim_attempt_end` (an ``O_EXCL`` marker file, safe across processes and
nodes of a shared filesystem); the loser of the race writes nothing.

Appends go through :func:`orchestrator.io.append_jsonl` (locked, whole lines). No torch import.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

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


def read_records(run_dir: PathLike) -> List[Dict[str, Any]]:
    """All records of ``<run_dir>/jobs.jsonl`` (malformed lines skipped)."""
    return read_jsonl(Path(run_dir) / JOBS_FILE)


# ---- attempts ------------------------------------------------------------------------------------


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


@dataclass
class Attempt:
    """One run of one job. Times are UNIX seconds; ``cause`` is None while it runs (or when nobody
    recorded its end)."""

    job_id: str
    attempt: int
    start: Optional[float] = None
    end: Optional[float] = None
    cause: Optional[str] = None
    iteration: Optional[int] = None
    """Iteration reached (the last finished one)."""
    start_iteration: Optional[int] = None
    """Iteration it resumed from (0 for a fresh start)."""
    host: Optional[str] = None
    message: str = ""
    requeued: bool = False
    restart: int = 0
    """In-place restarts of this attempt before this start (``cluster.max_restarts``; 0: its first start)."""
    restarted: bool = False
    """This start failed and the job restarted its ranks in place (same job id and attempt)."""
    recovery_s: Optional[float] = None
    """A restarted start: seconds from the failure to its first iteration."""
    failed: Optional[List[int]] = None
    """A start restarted in place: the ranks that did not outlive its failure (when the others reported)."""

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def own_records(records: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``jobs.jsonl``'s records less each lock-refused job's ``lock_refused`` and newest ``submitted`` before it
    (local ids are recycled pids): that job never trained here, so it is neither an attempt nor the run's job."""
    out: List[Dict[str, Any]] = []
    for rec in records:
        if rec.get("event") != "lock_refused":
            out.append(rec)
            continue
        job_id = str(rec.get("job_id"))
        hit = [i for i, r in enumerate(out) if r.get("event") == "submitted" and str(r.get("job_id")) == job_id]
        if hit:
            del out[hit[-1]]
    return out


def attempts(records: Iterable[Dict[str, Any]]) -> List[Attempt]:
    """Fold ``attempt_started``/``attempt_ended`` records (in file order) into one Attempt each.

    A submission without an ``attempt_started`` (a job that failed before training) still shows as
    attempt 0 of that job, except one whose rank 0 was refused the run lock (:func:`own_records` leaves it
    out: another run held the directory). The first ``attempt_ended`` of an
    attempt wins, except that one marked ``amends`` (the launcher's: the rank a signal killed, where a peer
    recorded its broken connection) replaces its cause and message. A submission or start
    under an id whose attempt already ended is a new job that got a recycled id (local job ids are
    process ids): it starts a new Attempt.
    """
    items: List[Attempt] = []
    current: Dict[Tuple[str, int], Attempt] = {}

    def fresh(key: Tuple[str, int]) -> Attempt:
        a = current[key] = Attempt(job_id=key[0], attempt=key[1])
        items.append(a)
        return a

    for rec in own_records(records):
        event, job_id = rec.get("event"), str(rec.get("job_id"))
        if event not in (
            "submitted",
            "attempt_started",
            "attempt_ended",
            "requeue_decision",
            "restart_decision",
            "restart_resumed",
        ):
            continue
        key = (job_id, 0 if event == "submitted" else int(rec.get("attempt") or 0))
        a = current.get(key)
        if event == "submitted":
            if a is None or a.end is not None:
                fresh(key).start = rec.get("time")
        elif event == "attempt_started":
            if a is None or a.end is not None:
                a = fresh(key)
            a.start, a.start_iteration, a.host = rec.get("time"), rec.get("iteration"), rec.get("host")
            a.restart = int(rec.get("restart") or 0)
            if a.iteration is None:
                a.iteration = rec.get("iteration")
        elif event == "requeue_decision":  # after a hang or a crash: recorded after the attempt's end
            if a is not None:
                a.requeued = a.requeued or bool(rec.get("requeued"))
        elif event == "restart_decision":  # runtime.faults.inplace: restarted in place, or not
            if a is not None:
                a.restarted = a.restarted or bool(rec.get("restart"))
                a.failed = rec.get("failed") or a.failed
        elif event == "restart_resumed":
            if a is not None and a.end is None:
                a.recovery_s = rec.get("recovery_s")
        elif rec.get("amends") and a is not None and a.end is not None:
            a.cause, a.message = rec.get("cause"), rec.get("message") or ""
        elif a is None or a.end is None:
            a = a or fresh(key)
            a.end, a.cause, a.message = rec.get("time"), rec.get("cause"), rec.get("message") or ""
            a.requeued = bool(rec.get("requeued"))
            if rec.get("iteration") is not None:
                a.iteration = rec.get("iteration")
    return sorted(items, key=lambda a: (a.start or a.end or 0.0, a.job_id, a.attempt))


def count_ended(records: Iterable[Dict[str, Any]], job_id: str, causes: Iterable[str]) -> int:
    """How many attempts of ``job_id`` ended with one of ``causes``."""
    wanted = set(causes)
    return sum(1 for a in attempts(records) if a.job_id == str(job_id) and a.cause in wanted)


def history_for_manifest(
    run_dir: PathLike, iteration: int, train_iters: int, current: Optional[Tuple[str, int]] = None
) -> List[Dict[str, Any]]:
    """The run's attempts as plain dicts, for a checkpoint manifest saved at ``iteration``.

    The attempt saving it (``current``, else the latest without an end) reports ``iteration`` and,
    when ``iteration >= train_iters`` (the final save), cause ``completed``; otherwise no cause yet.
    """
    items = attempts(read_records(run_dir))
    mine = None
    if current is not None:
        mine = next((a for a in items if (a.job_id, a.attempt) == (str(current[0]), int(current[1]))), None)
    if mine is None:
        mine = next((a for a in reversed(items) if a.end is None), None)
    if mine is not None:
        mine.iteration = int(iteration)
        if iteration >= train_iters and mine.cause is None:
            mine.cause = "completed"
    return [a.as_dict() for a in items]


def iterations_lost(items: List[Attempt]) -> int:
    """Iterations trained twice because of failures: for each start that ended in a failure (:data:`FAILURE_CAUSES`),
    the iteration it reached minus the one the next start resumed from."""
    lost = 0
    for a, b in zip(items, items[1:]):
        if a.cause in FAILURE_CAUSES and a.iteration is not None and b.start_iteration is not None:
            lost += max(0, a.iteration - b.start_iteration)
    return lost


def format_attempts(items: List[Attempt]) -> List[str]:
    """One line per attempt: ``job 123 attempt 0  <start> .. <end>  timeout (requeued)  iteration 131  <message>``; a
    running one ``since <start>  running``. Its state is said once: a message that begins with it (``hang: rank
    3``) loses that word."""

    def clock(t: Optional[float]) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"

    lines = []
    for a in items:
        span = f"{clock(a.start)} .. {clock(a.end)}" if a.end else f"since {clock(a.start)}"
        cause = a.cause or ("running" if a.end is None else "?")
        it = "-" if a.iteration is None else str(a.iteration)
        frm = f" (from {a.start_iteration})" if a.start_iteration else ""
        if a.recovery_s is not None:
            frm += f", {a.recovery_s:.1f} s from the failure to its first iteration"
        message = (a.message or "").removeprefix(f"{cause}:").strip()
        tail = f"  {message}" if message and a.cause not in ("completed",) else ""
        failed = f"; no word from rank(s) {','.join(map(str, a.failed))} after the failure" if a.failed else ""
        how = " (requeued)" if a.requeued else f" (restarted in place{failed})" if a.restarted else ""
        restart = f" restart {a.restart}" if a.restart else ""
        lines.append(f"job {a.job_id} attempt {a.attempt}{restart}  {span}  {cause}{how}  iteration {it}{frm}{tail}")
    return lines
