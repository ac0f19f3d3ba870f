"""After a failure inside a live job: restart in place (``cluster.max_restarts``) or apply the requeue policy.

The rank that claims a failed attempt's end (a crash, a lost peer, a declared hang: :mod:`~orchestrator.runtime.faults.guard`,
:mod:`~orchestrator.runtime.faults.watchdog`) calls :func:`decide`. With restarts left (counted in the run's
``jobs.jsonl``: ``restart_decision`` records of this job and attempt) it records ``restart_decision`` with
``restart: true`` and the rank's exception ends it with a failure, which makes its torch elastic agent start all
ranks again (:mod:`orchestrator.runtime.start.inplace`). With none left, today's policy applies
(:func:`~orchestrator.runtime.faults.requeue.requeue_for_failure`, ``cluster.max_failures``) and the decision says
which and why; the ranks then end without asking their agent for a restart.

The restarted ranks' rank 0 records ``attempt_started`` with ``restart: n`` (:func:`restart_number`) and, after its
first iteration, ``restart_resumed``: the failure's time, the iteration resumed and the seconds from the failure to
that first new iteration. No torch import.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.ckpt import history

_DECIDED: Optional[bool] = None


def agent_restarts() -> int:
    """``--max-restarts`` of this process's torch elastic agent (0 outside one)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return 0


def restart_decided() -> Optional[bool]:
    """This process's decision: True (restart in place), False (do not), None (none taken here)."""
    return _DECIDED


def decisions(records: List[Dict[str, Any]], job_id: str, attempt: int) -> List[Dict[str, Any]]:
    """The ``restart_decision`` records of one attempt of one job, in file order."""
    return [
        r
        for r in records
        if r.get("event") == "restart_decision"
        and str(r.get("job_id")) == str(job_id)
        and int(r.get("attempt") or 0) == int(attempt)
    ]


def decide(
    run_dir: str,
    job_id: str,
    attempt: int,
    cluster: Any,
    message: str,
    since: float = 0.0,
    world_size: int = 0,
    **fields: Any,
) -> Tuple[bool, str]:
    """After this attempt's failure (its end recorded): restart in place, or requeue per ``cluster.max_failures``.
    ``cluster``: the job's ClusterConfig (``max_restarts``, ``max_failures``).
    Returns (requeued?, one line saying which and why). ``fields`` (cause, reporter, iteration) go in the record,
    with ``failed``: the ranks a signal ended since ``since`` (their start) when their agents said so, else the ranks
    of ``world_size`` that did not report alive since then when some did (:mod:`~orchestrator.runtime.faults.lost`;
    without heartbeats, none is named)."""
    global _DECIDED
    from orchestrator.runtime.faults.lost import alive_since, signalled_since
    from orchestrator.runtime.faults.requeue import requeue_for_failure

    max_restarts, max_failures = int(cluster.max_restarts), int(cluster.max_failures)
    if not agent_restarts():  # no agent to restart the ranks: today's behaviour exactly
        return requeue_for_failure(run_dir, max_failures)
    used = sum(1 for r in decisions(history.read_records(run_dir), job_id, attempt) if r.get("restart"))
    alive, deadline = alive_since(run_dir, job_id, attempt, since), time.monotonic() + 2.0
    while world_size and 0 < len(alive) < world_size - 1 and time.monotonic() < deadline:  # until no report comes
        time.sleep(0.5)
        alive, before = alive_since(run_dir, job_id, attempt, since), alive
        if alive == before:
            break
    failed = sorted(set(range(world_size)) - alive) if alive else []
    signalled = signalled_since(run_dir, job_id, attempt, since)  # the ranks a signal ended (their agents say)
    failed = sorted(signalled) if signalled else failed
    record = dict(
        job_id=str(job_id),
        attempt=int(attempt),
        used=used,
        max_restarts=max_restarts,
        message=message,
        failed=failed,
        **fields,
    )
    if used < max_restarts:
        _DECIDED = True
        detail = (
            f"restarting all ranks in place: restart {used + 1} of cluster.max_restarts={max_restarts}, "
            "from the last complete checkpoint"
        )
        history.record_event(
            run_dir, "restart_decision", restart=True, restart_number=used + 1, detail=detail, **record
        )
        return False, detail
    _DECIDED = False
    requeued, detail = requeue_for_failure(run_dir, max_failures)
    detail = f"restarts used up ({used} of cluster.max_restarts={max_restarts}): {detail}"
    history.record_event(run_dir, "restart_decision", restart=False, requeued=requeued, detail=detail, **record)
    return requeued, detail


def follow(run_dir: str, job_id: str, attempt: int, since: float) -> Optional[Dict[str, Any]]:
    """The decision another rank took after ``since`` (None before it is written); a rank that did not claim the end
    takes it as its own (so every rank of the agent ends alike)."""
    global _DECIDED
    mine = [r for r in decisions(history.read_records(run_dir), job_id, attempt) if float(r.get("time") or 0) >= since]
    if not mine:
        return None
    _DECIDED = bool(mine[-1].get("restart"))
    return mine[-1]


def await_decision(run_dir: str, job_id: str, attempt: int, since: float, timeout_s: float) -> Optional[Dict[str, Any]]:
    """A rank that did not claim the failure's end: the claimer's decision (``requeue_decision``, or an
    ``attempt_ended`` that needs none) written after ``since`` (this start), waited for up to ``timeout_s``; taken
    as this rank's own (:func:`follow`) under an agent. None when none came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decision = next(
            (
                r
                for r in reversed(history.read_records(run_dir))
                if r.get("event") in ("requeue_decision", "attempt_ended")
                and r.get("job_id") == job_id
                and r.get("attempt") == attempt
                and r.get("decided") is not False
                and float(r.get("time") or 0) >= since
            ),
            None,
        )
        if decision is not None:
            if agent_restarts():  # end as the claimer decided: restarted, or not (the agent reads the exit status)
                follow(run_dir, job_id, attempt, since)
            return decision
        time.sleep(0.5)
    return None


def restart_number(run_dir: str, job_id: str, attempt: int) -> Tuple[int, Optional[Dict[str, Any]]]:
    """(n, the decision that asked it) for the ranks now starting: n restarts of this attempt decided so far
    (0 for its first start)."""
    asked = [r for r in decisions(history.read_records(run_dir), job_id, attempt) if r.get("restart")]
    return len(asked), (asked[-1] if asked else None)


def record_restart_start(run_dir: str, job_id: str, attempt: int) -> Dict[str, Any]:
    """Rank 0 of restarted ranks: the fields its ``attempt_started`` carries (``restart``, ``failed_at``), and the
    hang file of the failed start removed (it is this attempt's)."""
    number, asked = restart_number(run_dir, job_id, attempt) if agent_restarts() else (0, None)
    if not number or asked is None:
        return {}
    from orchestrator.runtime.faults.watchdog import hang_path

    try:
        hang_path(run_dir, job_id, attempt).unlink()
    except OSError:
        pass
    return {
        "restart": number,
        "failed_at": asked.get("failed_at") or asked.get("time"),
        "failure": asked.get("cause"),
        "failed_ranks": asked.get("failed"),
    }


def record_resumed(run_dir: str, attempt: Tuple[str, int], started: Dict[str, Any], iteration: int) -> None:
    """Rank 0 of restarted ranks, after their first iteration ``iteration`` (``attempt``: job id and attempt;
    ``started``: what :func:`record_restart_start` returned): ``restart_resumed`` with the recovery time."""
    failed_at = started.get("failed_at")
    now = time.time()
    history.record_event(
        run_dir,
        "restart_resumed",
        job_id=str(attempt[0]),
        attempt=int(attempt[1]),
        restart=started.get("restart"),
        resumed_from=iteration - 1,
        first_iteration=iteration,
        failed_at=failed_at,
        recovery_s=round(now - float(failed_at), 3) if failed_at else None,
    )
