"""Why a job failed, said once: a rank that returned an error, a local rank gone without a result (SIGKILL,
OOM; the signal read from its zombie), a job that ended without every result. Each check takes the state of
one :func:`orchestrator.submit.wait.wait` (``w``: its results, the job, the run), raises the job's own
explanation (:mod:`orchestrator.submit.outcome`) or that rank's last lines, and records how the attempt
ended. No torch import."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List

from orchestrator.errors import JobFailedError, ranks_died
from orchestrator.submit.liveness import dead_ranks
from orchestrator.submit.stop import cancel


def stderr_tail(job, task: int, lines: int = 25) -> str:
    """The last ``lines`` of task ``task``'s stderr (its stdout when stderr holds no traceback); "" when unreadable."""
    try:
        paths = job.task(task).paths
        text = ""
        for p in (paths.stderr, paths.stdout):
            if Path(p).exists():
                text = Path(p).read_text(errors="replace")
                if "Traceback" in text or "Error" in text:
                    break
        return "\n".join(text.rstrip().splitlines()[-lines:])
    except Exception:  # pragma: no cover - diagnostics only
        return ""


def check_failed_rank(w) -> None:
    """A rank returned an error: raise the job's own explanation, else that rank's last lines."""
    from orchestrator.submit import outcome

    failed = w.failed()
    if not failed:
        return
    job, errors = w.job, [w.results[i][1] for i in sorted(failed)]
    from orchestrator.errors import RunLockedError, SlowLinkError

    for kind in (RunLockedError, SlowLinkError):  # another run took the directory; a slow link refused
        refused = next((outcome.orchestrator_error(e) for e in errors if f"{kind.__name__}: " in str(e)), None)
        if refused:  # user errors (exit 2), found in the job
            cancel(w.job, w.cfg)
            raise kind(refused)
    known = outcome.known_failure(w.run_dir, w.job_id, errors)
    if known:
        raise w.fail(
            f"job {w.job_id}: {known} (logs: {Path(job.task(failed[0]).paths.stderr).parent}/)", "crashed", known
        )  # (a job that recorded its own end, a NaN stop or a hang, keeps it)
    # Often the root cause is a rank that died silently (SIGKILL, OOM) and the error above is its peers': say so.
    dead = dead_ranks(job, w.world_size, w.results) if w.local else outcome.srun_killed_after(job, errors)
    rank = failed[0]
    detail = w.results[rank][1]
    tail = str(detail).strip().splitlines()[-15:] if detail else []
    cause = f"{ranks_died(dead, '' if w.local else 'exit by signal 9, SIGKILL, per srun')}; then " if dead else ""
    srun = "" if w.local else outcome.srun_errors(job)
    raise w.fail(
        f"job {job.job_id}: {cause}rank {rank} failed:\n"
        + "\n".join(tail)
        + (f"\n{srun}" if srun else "")
        + f"\nlogs: {job.task(rank).paths.stderr}",
        "crashed",
        f"{cause}rank {rank} failed: {tail[-1] if tail else ''}",
    )  # status names the dead


def check_dead_local(w) -> None:
    """A local rank process gone without a result (SIGKILL, OOM): stop the others."""
    from orchestrator.submit import outcome

    if not w.local or time.time() - w.started <= 5 or w.asked is not None:
        return  # (ranks that stop on request exit without results: check_stopped waits for the job's end)
    dead = dead_ranks(w.job, w.world_size, w.results)
    if not dead:
        return
    logs = Path(w.job.task(dead[0]).paths.stderr).parent
    how = death_signals(w, dead)
    stopped = outcome.stopped_itself(w.run_dir, w.job_id, w.c)
    errors = [r[1] for r in w.results.values() if r[0] != "success"]  # a forking rank 0 names the signal
    if known := stopped or outcome.known_failure(w.run_dir, w.job_id, errors):
        raise w.fail(f"job {w.job_id}: {known} (logs: {logs}/)", None if stopped else "crashed", known)
    raise w.fail(
        f"job {w.job.job_id}: {ranks_died(dead, how)}; the other ranks were stopped.\nlogs: {logs}/",
        "crashed",
        ranks_died(dead, how),
    )


def death_signals(w, dead: List[int]) -> str:
    """How forked ranks that died ended, when a signal did (``exit by signal 9, SIGKILL``): read from their
    zombies (runtime.start.forked.zombie_signals), else from the forking rank 0's result — it reaps them and
    fails a moment after their death breaks its collective, so it gets up to 10 s to say so. "" otherwise."""
    if not getattr(w.job, "forks_ranks", False) or 0 in dead:
        return ""
    from orchestrator.runtime.start.forked import zombie_signals

    deadline = time.monotonic() + 10.0
    while True:
        found = zombie_signals(w.job.paths.folder, str(w.job.job_id))
        lines = sorted({found[r] for r in dead if r in found})
        if lines:
            return "; ".join(lines)
        w.read_results()
        if 0 in w.results or time.monotonic() > deadline:
            return ""
        time.sleep(0.2)


def check_ended(w, ended: bool) -> None:
    """The job ended without every result: after a short grace for result files, explain it."""
    from orchestrator.submit import outcome

    if not ended:
        w.ended_since = None
        return
    cancelled = not w.local and w.state.startswith("CANCELLED")
    # Allow result files a moment to land after the processes exit (the state is re-read every poll, so a transient
    # answer does not end the wait). A local task writes its result before it exits, here: a short grace is enough.
    w.ended_since = w.ended_since or time.time()
    if time.time() - w.ended_since <= (3 if cancelled or w.local else 15):
        return
    job, state, logs = w.job, w.state, Path(w.job.paths.stderr).parent
    missing = [i for i in range(w.world_size) if i not in w.results]
    stopped = outcome.stopped_itself(w.run_dir, w.job_id, w.c)  # e.g. its requeues used up: no srun lines
    if (known := stopped or outcome.known_failure(w.run_dir, w.job_id)) and not cancelled:
        if not stopped:  # e.g. a full disk the ranks could not record (kept if they did)
            outcome.record_end(w.run_dir, w.job_id, "crashed", known)
        raise JobFailedError(f"job {w.job_id}{'' if stopped else f' ({state})'}: {known} (logs: {logs}/)")
    outcome.record_end(
        w.run_dir,
        w.job_id,
        "crashed" if w.local else outcome.slurm_cause(state),
        f"job ended ({state}) without results from rank(s) {missing}",
    )
    if cancelled:
        raise JobFailedError(
            f"job {job.job_id} was cancelled (scancel or the scheduler) before it finished; "
            f"rerunning the same command resumes from its latest checkpoint, if it saved one.\n"
            f"logs: {logs}/"
        )
    srun = "" if w.local else outcome.srun_errors(job)
    raise JobFailedError(
        f"job {job.job_id} ended ({state}) without results from rank(s) {missing}:\n"
        + (f"{srun}\n" if srun else "")
        + f"{stderr_tail(job, missing[0])}\nlogs: {job.task(missing[0]).paths.stderr}"
    )
