"""How a waited-on job ended, in one line: what the job recorded, else what its ranks raised.

The launcher (:func:`orchestrator.submit.wait.wait`) asks here before it words a failure:

* :func:`known_failure` — the job's own account: the ``attempt_ended`` record of its latest attempt
  (a NaN stop, a declared hang, with the one-line message the job wrote), else the message of an
  :class:`~orchestrator.errors.OrchestratorError` that ended a rank (a full disk, a resume refused in
  the job), read from the end of the rank's traceback, else a full disk under the run directory
  (when it is full the ranks can write neither results nor logs);
* :func:`record_end` — when the job could not record its end (ranks killed, node lost, the launcher
  gave up or was interrupted), the launcher records it, once (``claim_attempt_end``);
* :func:`requeued_after_failure` — a failed attempt that the job requeued itself
  (``cluster.max_failures``): its error results are stale, the launcher keeps waiting.

No torch import.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from orchestrator.ckpt import attempts, history
from orchestrator.errors import PEER_LOST, RANKS_DIED

_ERROR_LINE = re.compile(r"^orchestrator\.[\w.]*(Error|Exception): (.*)$")
_JOB_CAUSES = ("nan", "spike", "hang", "disk full")  # a crash's record names one rank's error; its traceback says more


def _latest(run_dir: str, job_id: str) -> Optional[attempts.Attempt]:
    items = [a for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == str(job_id)]
    return max(items, key=lambda a: (a.attempt, a.restart)) if items else None  # (in-place restarts: same attempt)


def orchestrator_error(text: Any) -> Optional[str]:
    """The message of the last ``orchestrator....Error: message`` line of a traceback (its first line)."""
    for line in reversed(str(text or "").strip().splitlines()):
        m = _ERROR_LINE.match(line.strip())
        if m:
            return m.group(2).strip()
    return None


def known_failure(run_dir: str, job_id: str, errors: Iterable[Any] = ()) -> Optional[str]:
    """One line saying why job ``job_id`` failed, from its own records or its ranks' errors; None
    when neither says more than a traceback would."""
    latest = _latest(run_dir, job_id)
    if latest is not None and latest.cause in _JOB_CAUSES and latest.message:
        return latest.message
    for text in errors:
        message = orchestrator_error(text)
        if message:
            return message
    return disk_full(run_dir)


def disk_full(run_dir: str) -> Optional[str]:
    """The disk-full line when the run directory's filesystem is out of space (then the ranks could
    write neither their results nor their logs): it names the newest checkpoint without a manifest
    (the save that ran out), ENOSPC and the free space."""
    from pathlib import Path

    from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
    from orchestrator.runtime.faults.diskspace import disk_full_message, out_of_space, write_full_message

    if not out_of_space(run_dir):
        return None
    base = Path(run_dir) / CHECKPOINTS_DIR
    iters = sorted(p for p in base.glob("iter_*") if p.is_dir()) if base.is_dir() else []
    torn = [p for p in iters if not (p / "manifest.json").exists()]
    return disk_full_message(torn[-1]) if torn else write_full_message(run_dir, run_dir)


def stopped_itself(run_dir: str, job_id: str, cluster) -> Optional[str]:
    """One plain line (after ``job <id>: ``) when job ``job_id`` ended by stopping itself after a save, not
    requeued (a time limit or preemption with ``cluster.max_num_timeout`` requeues used up, a local time
    limit, a stop signal):
    what stopped it, the requeues used and the checkpoint a rerun resumes from; else None. Such a job
    writes no result files, and its end is no crash."""
    from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
    from orchestrator.runtime.faults.diskspace import latest_checkpoint

    records = history.read_records(run_dir)
    mine = [a for a in attempts.attempts(records) if a.job_id == str(job_id)]
    latest = max(mine, key=lambda a: (a.attempt, a.restart)) if mine else None
    if latest is None or latest.requeued or latest.cause not in (*history.TIMEOUT_CAUSES, "interrupted"):
        return None
    stops = [r for r in records if r.get("event") == "stopped" and str(r.get("job_id")) == str(job_id)]
    if not stops:
        return None  # ended by the launcher (Ctrl-C, its time bound), not by the job's own stop
    used = sum(1 for a in mine if a.requeued and a.cause in history.TIMEOUT_CAUSES)
    what = {
        "timeout": f"reached its time limit (cluster.timeout_min={cluster.timeout_min})",
        "preempted": "was preempted",
    }.get(latest.cause, "was stopped by a signal")
    if cluster.kind != "slurm":
        requeues = "local runs are not requeued"
    elif latest.cause in history.TIMEOUT_CAUSES and used >= cluster.max_num_timeout:
        requeues = f"its requeues are used up ({used} of cluster.max_num_timeout={cluster.max_num_timeout})"
    elif latest.cause in history.TIMEOUT_CAUSES:  # the job's own reason, e.g. the limit passed during the save
        requeues = (
            f"not requeued ({used} of cluster.max_num_timeout={cluster.max_num_timeout} used): "
            f"{stops[-1].get('detail') or 'the job did not say why'}"
        )
    else:
        requeues = f"not requeued ({used} requeue(s) used)"
    ckpt = latest_checkpoint(run_dir)
    resume = (
        f"rerun the same command to resume from {run_dir}/{CHECKPOINTS_DIR}/{ckpt}"
        if ckpt
        else "no checkpoint was saved, so a rerun starts from scratch"
    )
    saved = f" after saving iteration {latest.iteration}" if ckpt else ""
    return f"{what} and stopped{saved}; {requeues}; {resume}"


def failed_attempt_message(run_dir: str, job_id: str) -> Optional[str]:
    """The message of the latest attempt of ``job_id`` when it ended in a failure (hang, node failure,
    crash: recorded before the job requeues itself), else None."""
    latest = _latest(run_dir, job_id)
    if latest is not None and latest.cause in history.FAILURE_CAUSES:
        return latest.message or latest.cause
    return None


def requeued_after_failure(run_dir: str, job_id: str) -> bool:
    """Whether the latest attempt of ``job_id`` ended in a failure the job requeued."""
    latest = _latest(run_dir, job_id)
    return latest is not None and latest.requeued and latest.cause in history.FAILURE_CAUSES


def record_end(run_dir: str, job_id: str, cause: str, message: str) -> None:
    """Record the end of the latest attempt of ``job_id`` unless the job (or anyone) already did (a crash
    whose line is a full disk's is recorded as ``disk full``). A crash the launcher found ranks dead for (a
    :func:`~orchestrator.errors.ranks_died` line) amends a crash a surviving peer recorded first: the dead ranks
    are its cause, the peer's broken connection follows. So does a ``node failure`` the launcher saw (a host's SSH
    session lost: ``cluster=hosts``) where a rank recorded the crash it caused (``BrokenPipeError`` on the lost
    session's output, a peer's broken collective)."""
    from orchestrator.runtime.faults.diskspace import DISK_FULL

    cause = "disk full" if cause == "crashed" and message.startswith(DISK_FULL) else cause
    latest = _latest(run_dir, job_id)
    attempt = latest.attempt if latest is not None else 0
    if latest is not None and latest.end is not None:
        died = cause == latest.cause == "crashed" and RANKS_DIED.match(message) and not RANKS_DIED.match(latest.message)
        if died or (cause == "node failure" and latest.cause == "crashed"):
            with contextlib.suppress(OSError):  # bookkeeping never hides the failure itself
                history.record_attempt_ended(
                    run_dir,
                    job_id,
                    attempt,
                    cause,
                    iteration=latest.iteration,
                    amends=True,
                    message=f"{message.splitlines()[0]}; {'its peers' if died else 'the ranks'}' errors followed: "
                    + latest.message,
                    recorded_by="launcher",
                )
        return
    from orchestrator.submit.run_records import last_metrics

    reached = last_metrics(run_dir)[0]  # the iteration reached (the attempt's start when it logged none)
    if latest is not None and latest.iteration is not None and (reached is None or reached < latest.iteration):
        reached = latest.iteration
    try:
        if history.claim_attempt_end(run_dir, job_id, attempt):
            history.record_attempt_ended(
                run_dir,
                job_id,
                attempt,
                cause,
                iteration=reached,
                message=message.splitlines()[0] if message else "",
                recorded_by="launcher",
            )
    except OSError:  # bookkeeping never hides the failure itself
        pass


def srun_errors(job, lines: int = 6) -> str:
    """srun's own error lines from the batch log (e.g. ``srun: error: node: task 1: Killed``): the
    rank that died first, which its peers' broken-collective errors do not name."""
    try:
        path = Path(job.paths.stderr)  # the batch script's stderr (task 0's log) holds srun's messages
        found = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if line.startswith("srun: error:") and "task" in line
        ]
        return "\n".join(found[-lines:])
    except Exception:  # pragma: no cover - diagnostics only
        return ""


def srun_killed(job) -> List[int]:
    """The tasks (ranks) srun reported killed by a signal: ``srun: error: node2: task 1: Killed`` (or ``tasks 2-3``)."""
    killed: List[int] = []
    for spec in re.findall(r"^srun: error: [^:]+: tasks? ([0-9,-]+): Killed$", srun_errors(job, lines=50), re.M):
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            killed += range(int(lo), int(hi or lo) + 1)
    return sorted(set(killed))


def srun_killed_after(job, errors: Iterable[Any], wait_s: float = 10.0) -> List[int]:
    """:func:`srun_killed`, waiting up to ``wait_s`` for srun's line when a failed rank's error is a peer's death
    (:data:`~orchestrator.errors.PEER_LOST`): the survivor's broken connection reaches the launcher before srun has
    reaped the killed task and said so (seen under load: the record named the survivor, not the killed rank)."""
    deadline = time.monotonic() + (wait_s if any(w in str(e) for e in errors for w in PEER_LOST) else 0.0)
    while True:
        killed = srun_killed(job)
        if killed or time.monotonic() >= deadline:
            return killed
        time.sleep(0.5)


def slurm_cause(state: str) -> str:
    """The attempt cause for a SLURM end state the job did not record itself."""
    if state.startswith("NODE_FAIL") or state == "BOOT_FAIL":
        return "node failure"
    if state in ("TIMEOUT", "DEADLINE"):
        return "timeout"
    if state == "PREEMPTED":
        return "preempted"
    if state.startswith("CANCELLED"):
        return "interrupted"
    return "crashed"


def say_restarts(run_dir: str, job_id: str, seen: int) -> int:
    """Print each in-place restart decision of ``job_id`` after the first ``seen`` (its failure, then what was
    decided: :mod:`orchestrator.runtime.faults.inplace`), and each node left out or spare joined
    (:mod:`orchestrator.runtime.start.spares`); returns how many there are now."""
    decided = [
        r
        for r in history.read_records(run_dir)
        if str(r.get("job_id")) == str(job_id)
        and r.get("event") in ("restart_decision", "node_left_out", "spare_joined")
    ]
    for r in decided[seen:]:
        detail = f"\n[orchestrator] job {job_id}: {r['detail']}" if r.get("detail") else ""
        print(f"[orchestrator] job {job_id}: {r.get('message')}{detail}", flush=True)
    return len(decided)


def dead_tasks(run_dir: str, job_id: str) -> Dict[int, str]:
    """``{task: host}``: the tasks of ``job_id``'s latest attempt whose node died and a spare took its place
    (:mod:`orchestrator.runtime.start.spares`: ``node_left_out`` with the dead node's task, said by a live node, and
    ``spare_joined`` replacing it). Such a task never writes its result; the job's ranks ran on without it."""
    mine = [r for r in history.read_records(run_dir) if str(r.get("job_id")) == str(job_id)]
    latest = max((int(r.get("attempt") or 0) for r in mine), default=0)
    mine = [r for r in mine if int(r.get("attempt") or 0) == latest]
    replaced = {r.get("replaces") for r in mine if r.get("event") == "spare_joined"}
    return {
        int(r["task"]): str(r["host"])
        for r in mine
        if r.get("event") == "node_left_out" and r.get("task") is not None and r.get("host") in replaced
    }
