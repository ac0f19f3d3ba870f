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
from orchestrator.errors import JobFailedError
from orchestrator.slurm import slurm_state
from orchestrator.submit import failure_report
from orchestrator.submit.jobs import SLURM_ENDED
from orchestrator.submit.liveness import is_stale, read_result, result_mtime
from orchestrator.submit.progress import Progress
from orchestrator.submit.stop import cancel  # noqa: F401 - the launcher's way to end a job at once, used here


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

    def summaries(self) -> Optional[List[Any]]:
        """Every task's summary once each wrote its result, or (a job with spares) once the tasks without one are
        those of dead nodes a spare took the place of (``{"ranks": {}, "left_out": host}`` for them); else None."""
        if len(self.results) == self.world_size:
            return [self.results[i][1] for i in range(self.world_size)]
        if not (self.c.max_restarts and getattr(self.c, "spare_nodes", 0) and self.results):
            return None
        from orchestrator.submit import outcome

        gone = outcome.dead_tasks(self.run_dir, self.job_id)
        if not gone or any(i not in self.results and i not in gone for i in range(self.world_size)):
            return None
        return [
            self.results[i][1] if i in self.results else {"ranks": {}, "left_out": gone[i]}
            for i in range(self.world_size)
        ]

    def failed(self) -> List[int]:
        return [i for i, r in self.results.items() if r[0] != "success"]

    def check_failed_rank(self) -> None:
        """A rank returned an error: raise the job's own explanation, else that rank's last lines."""
        failure_report.check_failed_rank(self)

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
        failure_report.check_dead_local(self)

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
        failure_report.check_ended(self, ended)

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
                summaries = w.summaries()
                if summaries is not None:
                    return summaries
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
            signals.end_words(),
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
