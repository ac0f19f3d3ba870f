"""Watching a submitted job until it ends: :func:`wait` and :func:`cancel`.

:func:`wait` reads each task's submitit result file, cancels the whole job as soon as one rank fails (the others
would block in a collective until the process-group timeout) and bounds every wait by the job's time limit plus a
margin. A SLURM job's state comes from ``scontrol`` (accounting may be absent, submitit polls sacct rarely): a job
cancelled outside our control is reported, not waited on forever; a signal to the launcher never cancels it.
No torch import.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.config.schema import JobConfig
from orchestrator.errors import JobFailedError, ranks_died
from orchestrator.slurm import slurm_state
from orchestrator.submit.jobs import SLURM_ENDED
from orchestrator.submit.liveness import dead_ranks, is_stale, read_result, result_mtime
from orchestrator.submit.progress import Progress
from orchestrator.submit.stop import cancel  # noqa: F401 - the launcher's way to end a job at once, used here


def _stderr_tail(job, task: int, lines: int = 25) -> str:
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


def _pause(job, cfg: JobConfig) -> None:
    """One poll interval; for a local job, less when its controller exits meanwhile (the ranks' results
    are then all written: the launcher returns at once instead of up to ``cluster.poll_interval_s`` late)."""
    process = getattr(job, "_process", None) if cfg.cluster.kind == "local" else None
    if process is None or process.poll() is not None:
        time.sleep(cfg.cluster.poll_interval_s)
        return
    try:
        process.wait(timeout=cfg.cluster.poll_interval_s)
    except subprocess.TimeoutExpired:
        pass


class _Wait:
    """The state of one :func:`wait`: results read so far, requeues seen, running time counted."""

    def __init__(self, job, cfg: JobConfig, world_size: int, tasks: Optional[int] = None):  # tasks: see wait()
        from orchestrator.runtime.faults.watchdog import JobWatch

        self.job, self.cfg, self.c, self.world_size = job, cfg, cfg.cluster, tasks or world_size
        self.run_dir, self.job_id = cfg.run.dir, str(job.job_id)
        hang_s = cfg.training.hang_timeout_s
        self.watch = JobWatch(self.run_dir, self.job_id, world_size, hang_s) if hang_s else None
        self.stale: Dict[int, float] = {}  # result files of an attempt that failed and was requeued (by mtime)
        self.bound_s = 60 * self.c.timeout_min * (self.c.max_num_timeout + 1) + 300
        self.counted_s = 0.0  # time the job has been running (not pending) while we waited
        self.last_poll = self.started = time.time()
        self.results: Dict[int, Tuple[str, Any]] = {}
        self.ended_since: Optional[float] = None
        self.requeues, self.state = 0, ""
        self.local = self.c.kind == "local"
        self.asked: Optional[Dict[str, Any]] = None  # the stop asked of the job (ckpt.stop), once seen
        self.restarts_seen = 0  # in-place restart decisions already reported (cluster.max_restarts)

    def fail(self, message: str, cause: Optional[str] = None, detail: str = "") -> JobFailedError:
        """Cancel the job, record how its attempt ended (``cause``), return the error to raise."""
        from orchestrator.submit import outcome

        cancel(self.job, self.cfg)
        if cause:
            outcome.record_end(self.run_dir, self.job_id, cause, detail)
        return JobFailedError(message)

    def read_results(self) -> None:
        from orchestrator.submit import outcome

        now = time.time()
        if self.local or self.state != "PENDING":
            self.counted_s += now - self.last_poll
        self.last_poll = now
        listed: Dict[Path, set] = {}  # one listing of the results' folder, not one look-up per rank
        for i in range(self.world_size):
            path = Path(self.job.task(i).paths.result_pickle)
            if path.parent not in listed:
                listed[path.parent] = set(os.listdir(path.parent)) if path.parent.is_dir() else set()
            if i not in self.results and path.name in listed[path.parent] and not is_stale(i, path, self.stale):
                r = read_result(path)
                if r is not None:
                    self.results[i] = r
        if self.failed() and not self.local and outcome.requeued_after_failure(self.run_dir, self.job_id):
            self.stale.update({i: result_mtime(Path(self.job.task(i).paths.result_pickle)) for i in self.results})
            self.results.clear()  # the requeued attempt writes its own results

    def failed(self) -> List[int]:
        return [i for i, r in self.results.items() if r[0] != "success"]

    def check_failed_rank(self) -> None:
        """A rank returned an error: raise the job's own explanation, else that rank's last lines."""
        from orchestrator.submit import outcome

        failed = self.failed()
        if not failed:
            return
        job, errors = self.job, [self.results[i][1] for i in sorted(failed)]
        from orchestrator.errors import RunLockedError, SlowLinkError

        for kind in (RunLockedError, SlowLinkError):  # another run took the directory; a slow link refused
            refused = next((outcome.orchestrator_error(e) for e in errors if f"{kind.__name__}: " in str(e)), None)
            if refused:  # user errors (exit 2), found in the job
                cancel(self.job, self.cfg)
                raise kind(refused)
        known = outcome.known_failure(self.run_dir, self.job_id, errors)
        if known:
            raise self.fail(
                f"job {self.job_id}: {known} (logs: {Path(job.task(failed[0]).paths.stderr).parent}/)", "crashed", known
            )  # (a job that recorded its own end, a NaN stop or a hang, keeps it)
        # Often the root cause is a rank that died silently (SIGKILL, OOM) and the error above is its peers': say so.
        dead = dead_ranks(job, self.world_size, self.results) if self.local else outcome.srun_killed_after(job, errors)
        rank = failed[0]
        detail = self.results[rank][1]
        tail = str(detail).strip().splitlines()[-15:] if detail else []
        cause = (
            f"{ranks_died(dead, '' if self.local else 'exit by signal 9, SIGKILL, per srun')}; then " if dead else ""
        )
        srun = "" if self.local else outcome.srun_errors(job)
        raise self.fail(
            f"job {job.job_id}: {cause}rank {rank} failed:\n"
            + "\n".join(tail)
            + (f"\n{srun}" if srun else "")
            + f"\nlogs: {job.task(rank).paths.stderr}",
            "crashed",
            f"{cause}rank {rank} failed: {tail[-1] if tail else ''}",
        )  # status names the dead

    def check_stopped(self, ended: bool, signals) -> None:
        """The job ended after a stop asked of it (a signal to this launcher, ``orchestrator stop``):
        raise :class:`~orchestrator.submit.signals.JobStopped` (its line: where a rerun resumes)."""
        from orchestrator.ckpt import stop

        if signals.signum or stop.stop_path(self.run_dir).exists():
            self.asked = stop.read(self.run_dir, self.job_id)
        if self.asked is not None and ended:
            raise signals.stopped(self.asked)

    def check_dead_local(self) -> None:
        """A local rank process gone without a result (SIGKILL, OOM): stop the others."""
        from orchestrator.submit import outcome

        if not self.local or time.time() - self.started <= 5 or self.asked is not None:
            return  # (ranks that stop on request exit without results: check_stopped waits for the job's end)
        dead = dead_ranks(self.job, self.world_size, self.results)
        if not dead:
            return
        logs = Path(self.job.task(dead[0]).paths.stderr).parent
        how = self.death_signals(dead)
        stopped = outcome.stopped_itself(self.run_dir, self.job_id, self.c)
        errors = [r[1] for r in self.results.values() if r[0] != "success"]  # a forking rank 0 names the signal
        if known := stopped or outcome.known_failure(self.run_dir, self.job_id, errors):
            raise self.fail(f"job {self.job_id}: {known} (logs: {logs}/)", None if stopped else "crashed", known)
        raise self.fail(
            f"job {self.job.job_id}: {ranks_died(dead, how)}; the other ranks were stopped.\nlogs: {logs}/",
            "crashed",
            ranks_died(dead, how),
        )

    def death_signals(self, dead: List[int]) -> str:
        """How forked ranks that died ended, when a signal did (``exit by signal 9, SIGKILL``): read from their
        zombies (runtime.start.forked.zombie_signals), else from the forking rank 0's result — it reaps them and
        fails a moment after their death breaks its collective, so it gets up to 10 s to say so. "" otherwise."""
        if not getattr(self.job, "forks_ranks", False) or 0 in dead:
            return ""
        from orchestrator.runtime.start.forked import zombie_signals

        deadline = time.monotonic() + 10.0
        while True:
            found = zombie_signals(self.job.paths.folder, str(self.job.job_id))
            lines = sorted({found[r] for r in dead if r in found})
            if lines:
                return "; ".join(lines)
            self.read_results()
            if 0 in self.results or time.monotonic() > deadline:
                return ""
            time.sleep(0.2)

    def poll_scheduler(self) -> bool:
        """Read the job's state; report a requeue; True once the job has ended."""
        from orchestrator.submit import outcome

        if self.local:
            self.state = self.job.state
            return self.state != "RUNNING"
        self.state, restarts = slurm_state(self.job_id)
        if restarts > self.requeues:  # PENDING/REQUEUED after a requeue: not an end, keep waiting
            self.requeues = restarts
            failure = outcome.failed_attempt_message(self.run_dir, self.job_id)
            if failure is not None:  # srun's lines name the node and the tasks that died
                srun = outcome.srun_errors(self.job)
                print(
                    f"[orchestrator] job {self.job_id} failed: {failure}"
                    + (f"\n{srun}" if srun else "")
                    + f"\n[orchestrator] job {self.job_id} requeued after a failure (cluster.max_failures="
                    f"{self.c.max_failures}); it resumes from its latest checkpoint",
                    flush=True,
                )
            else:
                print(
                    f"[orchestrator] job {self.job_id} requeued ({self.requeues} of at most "
                    f"{self.c.max_num_timeout}); it resumes from its latest checkpoint when SLURM restarts it",
                    flush=True,
                )
        return self.state in SLURM_ENDED

    def check_ended(self, ended: bool) -> None:
        """The job ended without every result: after a short grace for result files, explain it."""
        from orchestrator.submit import outcome

        if not ended:
            self.ended_since = None
            return
        cancelled = not self.local and self.state.startswith("CANCELLED")
        # Allow result files a moment to land after the processes exit (the state is re-read every poll, so a transient
        # answer does not end the wait). A local task writes its result before it exits, here: a short grace is enough.
        self.ended_since = self.ended_since or time.time()
        if time.time() - self.ended_since <= (3 if cancelled or self.local else 15):
            return
        job, state, logs = self.job, self.state, Path(self.job.paths.stderr).parent
        missing = [i for i in range(self.world_size) if i not in self.results]
        stopped = outcome.stopped_itself(self.run_dir, self.job_id, self.c)  # e.g. its requeues used up: no srun lines
        if (known := stopped or outcome.known_failure(self.run_dir, self.job_id)) and not cancelled:
            if not stopped:  # e.g. a full disk the ranks could not record (kept if they did)
                outcome.record_end(self.run_dir, self.job_id, "crashed", known)
            raise JobFailedError(f"job {self.job_id}{'' if stopped else f' ({state})'}: {known} (logs: {logs}/)")
        outcome.record_end(
            self.run_dir,
            self.job_id,
            "crashed" if self.local else outcome.slurm_cause(state),
            f"job ended ({state}) without results from rank(s) {missing}",
        )
        if cancelled:
            raise JobFailedError(
                f"job {job.job_id} was cancelled (scancel or the scheduler) before it finished; "
                f"rerunning the same command resumes from its latest checkpoint, if it saved one.\n"
                f"logs: {logs}/"
            )
        srun = "" if self.local else outcome.srun_errors(job)
        raise JobFailedError(
            f"job {job.job_id} ended ({state}) without results from rank(s) {missing}:\n"
            + (f"{srun}\n" if srun else "")
            + f"{_stderr_tail(job, missing[0])}\nlogs: {job.task(missing[0]).paths.stderr}"
        )

    def check_hang_and_bound(self, ended: bool) -> None:
        """Every rank silent past the hang allowance, or the launcher's time bound spent: cancel."""
        if self.watch is not None and not ended:
            if not self.local and self.state != "RUNNING":
                self.watch.pause()  # pending or requeued: silence does not count
            elif (hung := self.watch.hung()) is not None:
                raise self.fail(f"job {self.job_id}: {hung}", "hang", hung)
        if self.counted_s > self.bound_s:
            c = self.c
            raise self.fail(
                f"job {self.job.job_id} did not finish before the launcher's bound "
                f"(cluster.timeout_min={c.timeout_min} x {c.max_num_timeout + 1} + 5 min "
                f"of running time); cancelled",
                "interrupted",
                "the launcher's time bound ran out",
            )


def wait(
    job,
    cfg: JobConfig,
    world_size: int,
    progress: Optional[Progress] = None,
    tasks: Optional[int] = None,
    own_signals: bool = True,
) -> List[Dict[str, Any]]:
    """Block until every task of ``job`` ends; return the per-task summaries (``tasks``: the job's number of tasks
    when it is not one per rank, e.g. one torch elastic agent a node; default ``world_size``).

    Raises :class:`JobFailedError` (with the failing rank's last lines) when a rank fails, the
    job is cancelled, or it runs longer than ``cluster.timeout_min`` x (requeues + 1) plus 5
    minutes. On SLURM, time spent PENDING (in the queue, before the start or after a requeue)
    does not count towards that bound, and a requeue is reported and waited through: the requeued
    job writes its results into the same files when it finishes.

    A failure the job explained (a NaN stop, a declared hang, an orchestrator error such as a full
    disk: :mod:`orchestrator.submit.outcome`) is reported in one line. Every rank silent (no
    heartbeat) for ``training.hang_timeout_s`` + 60 s: the job is cancelled as hung. An end the job
    could not record (killed ranks, a lost node, Ctrl-C) is recorded in the run's history.
    """
    from orchestrator.submit import outcome
    from orchestrator.submit.signals import Detached, JobStopped, WaitSignals, say_detached

    w = _Wait(job, cfg, world_size, tasks)
    signals = WaitSignals(cfg, w.job_id, install=own_signals)  # False: a SLURM sweep's handlers (it says the detach)
    try:
        with signals:
            while True:
                if progress is not None:
                    progress.poll()
                w.read_results()
                w.restarts_seen = outcome.say_restarts(w.run_dir, w.job_id, w.restarts_seen) if w.c.max_restarts else 0
                w.check_failed_rank()
                if len(w.results) == w.world_size:
                    return [w.results[i][1] for i in range(w.world_size)]
                ended = w.poll_scheduler()
                w.check_stopped(ended, signals)
                w.check_dead_local()
                w.check_ended(ended)
                w.check_hang_and_bound(ended)
                _pause(job, cfg)
    except Detached as exc:  # a SLURM job runs on: never cancelled by a signal to its launcher
        if own_signals:
            say_detached(exc, {cfg.run.dir: w.job_id})
        raise
    except JobStopped:
        raise
    except KeyboardInterrupt:  # a second signal, or one before the handlers were in place: stop at once
        if not signals.held:  # a SLURM job: never cancelled by a signal to its launcher, however early
            raise signals.detached_late(own_signals) from None
        cancel(job, cfg)
        outcome.record_end(
            w.run_dir,
            w.job_id,
            "interrupted",
            "the launcher was interrupted a second time: stopped at once, unsaved"
            if signals.again
            else "the launcher was interrupted (Ctrl-C or a signal)",
        )
        if signals.again:
            raise signals.ended_at_once() from None
        raise
    finally:
        if progress is not None:
            try:
                progress.poll()
                progress.close()
            except OSError:  # the terminal went away (SIGHUP)
                pass
