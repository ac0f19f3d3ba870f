"""Which iterations a run trained when, and which of them it kept: the spans the goodput account is cut from.

A run's ``metrics.jsonl`` has a record every ``training.log_interval`` iterations (and at the first, each save and
stop); its ``jobs.jsonl`` has each attempt's end with the iteration it reached. An iteration span is a stretch of
one attempt's iterations between two records (:func:`iteration_spans`), plus, for an attempt that ended past its
last record (a kill, a NaN or spike stop between logging iterations), the span from that record to the end
(:func:`tail_spans`): those iterations ran, and unless something kept them they are lost work.

An iteration is kept in its last run only (:func:`kept_shares`), and only up to the last save when the run's
final attempt ended without saving what it reached (a failure, a stop that could not save, a double Ctrl-C):
:func:`lost_tail`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclass
class Span:
    """Iterations ``first..last`` of one attempt, trained over ``[start, end)`` (UNIX seconds)."""

    start: float
    end: float
    first: int
    last: int
    attempt: str
    share: float = 1.0
    """The kept share of its iterations (the rest: lost work)."""


def attempt_key(rec: Dict[str, Any]) -> str:
    """``<job id>.<attempt>``: a row of the timeline (in-place restarts stay on their attempt's row, marked)."""
    return f"{rec.get('job_id')}.{int(rec.get('attempt') or 0)}"


def iteration_spans(metrics: Sequence[Dict[str, Any]], starts: Sequence[Tuple[float, str]]) -> List[Span]:
    """The iterations' records folded into spans: a record at iteration i covers the iterations since the
    previous record of the same attempt (the attempt's ``start`` event for its first), from that record's
    time to its own. Works whether a record is written every iteration or every ``log_interval``.
    ``starts``: ``(time, attempt key)`` of every attempt start, in time order."""
    spans: List[Span] = []
    prev: Optional[Tuple[float, int]] = None
    times = [t for t, _ in starts]
    for rec in metrics:
        if rec.get("event") == "start":
            prev = (float(rec["time"]), int(rec.get("iteration") or 0))
            continue
        if "event" in rec or rec.get("iteration") is None or rec.get("time") is None:
            continue
        t, it = float(rec["time"]), int(rec["iteration"])
        if prev is None or it <= prev[1]:  # no start seen (old records): the step's own time
            prev = (t - float(rec.get("step_time_s") or 0.0), it - 1)
        i = bisect.bisect_right(times, prev[0]) - 1
        spans.append(Span(prev[0], t, prev[1] + 1, it, starts[i][1] if i >= 0 else ""))
        prev = (t, it)
    return spans


def tail_spans(spans: Sequence[Span], attempts: Sequence[Any]) -> List[Span]:
    """``spans`` with, for each ended start (``attempts``: :class:`orchestrator.ckpt.attempts.Attempt`) that
    reached an iteration past its last record, a span from that record to the start's end: iterations
    ``last record + 1 .. reached`` ran then (a rank killed at 104 with records every 7 iterations, a spike stop at
    10 with a record at 1). In time order."""
    out = list(spans)
    for a in attempts:
        if a.end is None or a.iteration is None or a.start is None:
            continue
        key = f"{a.job_id}.{int(a.attempt or 0)}"
        mine = [sp for sp in spans if sp.attempt == key and a.start <= sp.start < a.end]
        if not mine:
            continue
        last = max(mine, key=lambda sp: sp.end)
        if int(a.iteration) > last.last and float(a.end) > last.end:
            out.append(Span(last.end, float(a.end), last.last + 1, int(a.iteration), key))
    return sorted(out, key=lambda sp: sp.start)


def kept_shares(spans: Sequence[Span], saved: Sequence[int], unsaved_end: bool) -> List[float]:
    """Each span's kept share: of its iterations, those not run again later (and, when the run's last attempt
    ended without saving what it reached, ``unsaved_end``, not past its last save)."""
    last_run: Dict[int, int] = {}
    for idx, sp in enumerate(spans):
        for it in range(sp.first, sp.last + 1):
            last_run[it] = idx
    limit = max(saved, default=0) if unsaved_end else None
    shares = []
    for idx, sp in enumerate(spans):
        n = sp.last - sp.first + 1
        kept = sum(1 for it in range(sp.first, sp.last + 1) if last_run[it] == idx and (limit is None or it <= limit))
        shares.append(kept / n if n > 0 else 0.0)
    return shares


def lost_tail(spans: Sequence[Span], saved: Sequence[int], unsaved_end: bool) -> int:
    """Iterations the run's last attempt reached past its last save when it ended without saving them (never
    redone: lost)."""
    if not unsaved_end or not spans:
        return 0
    reached = max(sp.last for sp in spans)
    return max(0, reached - max(saved, default=0))
