"""The fold of a run's ``jobs.jsonl`` records (:mod:`orchestrator.ckpt.history`) into attempts.

An *attempt* is one run of one job: ``(job_id, attempt)`` where ``attempt`` is SLURM's restart
count (0 for the first run, and always 0 locally). :func:`attempts` folds the records into one
:class:`Attempt` per run — what ``python -m orchestrator status --history`` prints
(:func:`format_attempts`) and what each checkpoint manifest copies (:func:`history_for_manifest`).
:func:`count_ended` counts ends by cause (the requeue limits), :func:`iterations_lost` the iterations
failures made the run train twice. Reading only: the records are written by :mod:`orchestrator.ckpt.history`.
No torch import.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from orchestrator.ckpt.history import FAILURE_CAUSES, PathLike, read_records


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
