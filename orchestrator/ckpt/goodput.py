"""Goodput: what share of a run's wall time trained, and where the rest went.

The account of a run over all its attempts (requeues, in-place restarts, stops and reruns), read from the
two records every run keeps: ``jobs.jsonl`` (submissions, attempt starts and ends, restarts: ckpt.history)
and ``metrics.jsonl`` (iterations, saves, loads, evaluations: the runtime).

Definitions (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
Meta 2024: the Effective Training Time Ratio):

* **wall**: from the first submission to the last record (to now while a run is live), seconds;
* **productive**: time spent in iterations that were kept (an iteration redone after a failure counts once,
  its last run; its earlier runs are *lost work*, and so are a failed final attempt's iterations past its last
  save);
* **ETTR** = productive / wall.

Every second of the wall goes to exactly one cause (:data:`CAUSES`), so they sum to the wall: an activity
the records time (a save's blocking part, a checkpoint load, an evaluation, the in-job sample-index build)
wins over the iterations' span it falls in; time no record covers is named by what the run was doing then
(waiting in the queue after a submission, starting up, detecting a failure and restarting until the first
new iteration, stopped until the next submission, shutting down after the last iteration).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from orchestrator.ckpt.goodput_spans import Span, attempt_key, iteration_spans, kept_shares, lost_tail, tail_spans
from orchestrator.ckpt.history import FAILURE_CAUSES, SIGNALLED_EVENT, read_records
from orchestrator.ckpt.rundir import metrics_path
from orchestrator.io import read_jsonl

PathLike = Union[str, Path]

PRODUCTIVE = "productive"
CAUSES = (
    PRODUCTIVE,
    "queued",
    "start-up",
    "data preparation",
    "checkpoint load",
    "save blocking",
    "evaluation",
    "lost work",
    "failure detection and restart",
    "hang timeout",
    "stopped",
    "shutdown",
)
"""Where the wall time went, in the order the account prints them."""

_STOP_CAUSES = frozenset({"interrupted", "by request", "exited", "completed", "timeout", "preempted"})
"""Attempt ends after which the run waits for someone (or the scheduler) to start it again."""
_REQUEUE_CAUSES = frozenset({"timeout", "preempted"})


@dataclass
class Segment:
    """One stretch of a run's timeline: ``[start, end)`` in UNIX seconds, its cause, and the attempt it belongs
    to (``"<job id>.<attempt>"``) for the timeline picture."""

    start: float
    end: float
    cause: str
    attempt: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Failure:
    """A failure the picture marks: when it was detected (UNIX s), its cause and the attempt it ended."""

    time: float
    cause: str
    attempt: str
    message: str = ""


@dataclass
class Account:
    """The goodput account of one run. ``seconds``: cause -> seconds (every cause of :data:`CAUSES`, summing to
    ``wall_s``); ``segments`` the timeline, in time order; ``kept_iterations`` / ``lost_iterations`` counts."""

    wall_s: float
    seconds: Dict[str, float]
    segments: List[Segment]
    failures: List[Failure] = field(default_factory=list)
    kept_iterations: int = 0
    lost_iterations: int = 0
    attempts: int = 0
    live: bool = False
    t0: float = 0.0

    @property
    def ettr(self) -> Optional[float]:
        """Effective training time ratio, productive / wall (None before anything ran)."""
        return self.seconds[PRODUCTIVE] / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> Dict[str, Any]:
        return {
            "event": "goodput",
            "wall_s": round(self.wall_s, 3),
            "ettr": None if self.ettr is None else round(self.ettr, 6),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "kept_iterations": self.kept_iterations,
            "lost_iterations": self.lost_iterations,
            "attempts": self.attempts,
            "failures": len(self.failures),
        }


def _timed_activities(metrics: Sequence[Dict[str, Any]], job_records: Sequence[Dict[str, Any]]) -> List[Segment]:
    """The activities the records time: saves (blocking part), loads, evaluations, the in-job index build."""
    out: List[Segment] = []
    last_iteration_time: Dict[int, float] = {}
    for rec in metrics:
        ev = rec.get("event")
        if ev is None and rec.get("iteration") is not None and rec.get("time") is not None:
            last_iteration_time[int(rec["iteration"])] = float(rec["time"])
        elif ev == "saved" and rec.get("started") is not None:
            s = float(rec["started"])
            out.append(Segment(s, s + float(rec.get("blocking_s") or 0.0), "save blocking"))
        elif ev == "start" and rec.get("load_s"):
            e = float(rec["time"])
            out.append(Segment(e - float(rec["load_s"]), e, "checkpoint load"))
        elif ev == "eval" and rec.get("time") is not None:
            s = last_iteration_time.get(int(rec.get("iteration") or -1))
            if s is not None:
                out.append(Segment(s, float(rec["time"]), "evaluation"))
    for rec in job_records:
        if rec.get("event") == "data_prepared" and rec.get("seconds"):
            e = float(rec["time"])
            out.append(Segment(e - float(rec["seconds"]), e, "data preparation"))
    return out


def _markers(job_records: Sequence[Dict[str, Any]]) -> List[Tuple[float, str, Optional[str], str]]:
    """What the run was doing from each point on, for time no activity covers: ``(time, state from then,
    cause of the uncovered time just before it or None, attempt)``, in time order."""
    out = []
    for rec in job_records:
        ev, t = rec.get("event"), rec.get("time")
        if t is None:
            continue
        t, cause, key = float(t), rec.get("cause"), attempt_key(rec)
        if ev == "submitted":  # a local job starts at once: no queue
            out.append((t, "start-up" if rec.get("cluster") == "local" else "queued", None, key))
        elif ev in ("job_running", "attempt_started"):
            out.append((t, "start-up", None, key))
        elif ev == SIGNALLED_EVENT:  # a rank died: down from here, even if no rank lived to record the end
            out.append((t, "failure detection and restart", "failure detection and restart", key))
        elif ev == "attempt_ended" and not rec.get("amends"):
            if cause == "hang":
                out.append((t, "failure detection and restart", "hang timeout", key))
            elif cause in FAILURE_CAUSES or cause in ("nan", "spike", "disk full"):
                out.append((t, "failure detection and restart", "failure detection and restart", key))
            elif cause in _REQUEUE_CAUSES and rec.get("requeued"):
                out.append((t, "queued", "shutdown", key))
            else:
                out.append((t, "stopped", "shutdown", key))
    return sorted(out, key=lambda m: m[0])


class _Covering:
    """Which of time-ordered, non-overlapping intervals (``start``/``end`` attributes) covers a time."""

    def __init__(self, items: Sequence[Any]):
        self.items = sorted(items, key=lambda x: x.start)
        self.starts = [x.start for x in self.items]

    def at(self, t: float) -> Optional[Any]:
        i = bisect.bisect_right(self.starts, t) - 1
        for j in range(i, max(i - 4, -1), -1):  # saves may overlap an iteration's record by a hair
            if self.items[j].start <= t < self.items[j].end:
                return self.items[j]
        return None


def _read(run_dir: PathLike) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    return read_records(run_dir), read_jsonl(metrics_path(run_dir))


def account(run_dir: PathLike, now: Optional[float] = None) -> Optional[Account]:
    """The goodput account of the run in ``run_dir``; None when it has no records yet. ``now`` (UNIX s) ends a
    live run's wall (default: the clock); an ended run's wall ends at its last record."""
    jobs, metrics = _read(run_dir)
    return account_from_records(jobs, metrics, now=now)


def account_from_records(
    jobs: Sequence[Dict[str, Any]], metrics: Sequence[Dict[str, Any]], now: Optional[float] = None
) -> Optional[Account]:
    """:func:`account` over the records themselves (``jobs.jsonl``'s and ``metrics.jsonl``'s, in file order)."""
    from orchestrator.ckpt.attempts import attempts

    times = [float(r["time"]) for r in (*jobs, *metrics) if isinstance(r.get("time"), (int, float))]
    if not times:
        return None
    subs = [float(r["time"]) for r in jobs if r.get("event") == "submitted" and r.get("time") is not None]
    items = attempts(jobs)
    live = bool(items) and items[-1].end is None
    t0 = min(subs) if subs else min(times)
    t_end = max(times) if not live else max(max(times), now if now is not None else time.time())
    starts = sorted((float(r["time"]), attempt_key(r)) for r in jobs if r.get("event") == "attempt_started")
    spans = tail_spans(iteration_spans(metrics, starts), items)
    # what the last attempt reached past its last save is lost unless it completed (a stop saves its iteration)
    unsaved_end = not live and bool(items) and items[-1].cause != "completed"
    saved = [int(r["iteration"]) for r in metrics if r.get("event") == "saved"]
    for sp, share in zip(spans, kept_shares(spans, saved, unsaved_end)):
        sp.share = share
    timed = _timed_activities(metrics, jobs)
    acc = _sweep(t0, t_end, spans, timed, _markers(jobs))
    reached = {it for sp in spans for it in range(sp.first, sp.last + 1)}
    acc.kept_iterations = len(reached) - lost_tail(spans, saved, unsaved_end)
    acc.lost_iterations = sum(sp.last - sp.first + 1 for sp in spans) - acc.kept_iterations
    acc.attempts, acc.live, acc.t0 = len(items), live, t0
    acc.failures = [
        Failure(a.end, a.cause, f"{a.job_id}.{a.attempt}", a.message)
        for a in items
        if a.end is not None and a.cause not in _STOP_CAUSES
    ]
    acc.failures = sorted(acc.failures + unclaimed_deaths(jobs), key=lambda f: f.time)
    return acc


def unclaimed_deaths(jobs: Sequence[Dict[str, Any]]) -> List[Failure]:
    """Deaths no attempt end followed: a rank a signal ended (:data:`SIGNALLED_EVENT`) after which its attempt
    started again (an in-place restart) with no ``attempt_ended`` of that attempt in between
    (its peers were stopped by their agents before any of them could record it). One failure per such restart."""
    out: List[Failure] = []
    pending: Dict[str, Dict[str, Any]] = {}
    for rec in jobs:
        ev, key = rec.get("event"), attempt_key(rec)
        if ev == SIGNALLED_EVENT and rec.get("time") is not None:
            pending.setdefault(key, rec)
        elif ev == "attempt_ended":
            pending.pop(key, None)
        elif ev == "attempt_started" and key in pending:
            death = pending.pop(key)
            out.append(Failure(float(death["time"]), "crashed", key, str(death.get("message") or "")))
    return out


def _sweep(
    t0: float,
    t_end: float,
    spans: Sequence[Span],
    timed: Sequence[Segment],
    markers: Sequence[Tuple[float, str, Optional[str], str]],
) -> Account:
    """Cut ``[t0, t_end)`` at every boundary and give each piece one cause: a timed activity, else an iteration
    span (kept share productive, the rest lost work), else what the markers say the run was doing."""
    bounds = {t0, t_end}
    for x in (*spans, *timed):
        bounds.update((min(max(x.start, t0), t_end), min(max(x.end, t0), t_end)))
    bounds.update(m[0] for m in markers if t0 < m[0] < t_end)
    cuts = sorted(bounds)
    by_span, by_timed = _Covering(spans), _Covering(timed)
    seconds = {c: 0.0 for c in CAUSES}
    segments: List[Segment] = []
    m_times = [m[0] for m in markers]
    state, recovering, key = "queued", False, ""
    k = 0
    for a, b in zip(cuts, cuts[1:]):
        while k < len(markers) and markers[k][0] <= a:
            _, state, _, key = markers[k]
            recovering = recovering or state == "failure detection and restart"
            k += 1
        mid = (a + b) / 2
        act, sp = by_timed.at(mid), by_span.at(mid)
        if sp is not None:  # training: time after its last record is iterations in flight (a live run's tail)
            recovering, key, state = False, sp.attempt or key, PRODUCTIVE
        if act is not None:
            cause, share = act.cause, None
        elif sp is not None:
            cause, share = PRODUCTIVE, sp.share
        else:
            j = bisect.bisect_left(m_times, b)
            before = markers[j][2] if j < len(markers) and markers[j][0] == b else None
            cause = before or ("failure detection and restart" if recovering else state)
            share = None
        if share is None:
            seconds[cause] += b - a
        else:
            seconds[PRODUCTIVE] += (b - a) * share
            seconds["lost work"] += (b - a) * (1 - share)
            cause = PRODUCTIVE if share >= 0.5 else "lost work"
        if segments and segments[-1].cause == cause and segments[-1].attempt == key and segments[-1].end == a:
            segments[-1].end = b
        else:
            segments.append(Segment(a, b, cause, key))
    return Account(wall_s=t_end - t0, seconds=seconds, segments=segments)
