"""Ending a rank for a requeue or a stop, and requeueing a SLURM job after a failure.

:class:`Requeued` / :class:`Stopped` (``SystemExit``: submitit writes no result file for them),
the job's identity, ``scontrol requeue`` that survives SLURM's own SIGTERM, and
:func:`requeue_for_failure` (failures against ``cluster.max_failures``). Used by the signal path
(:mod:`orchestrator.runtime.faults.preempt`) and the guard (:mod:`orchestrator.runtime.faults.guard`);
imports neither. torch is imported lazily.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from orchestrator.slurm import (
    JOB_ID_VAR,
    UNREADABLE,
    on_slurm,
    restart_count,
    restarts_of,
    scontrol_job,
    slurm_job_id,
    slurm_state,
)

REQUEUE_EXIT_CODE = 75
"""Exit status of every rank after a successful requeue (EX_TEMPFAIL: "try again later")."""
STOP_EXIT_CODE = 76
"""Exit status after a graceful stop without requeue (not a success: training did not finish)."""
_EXIT_WATCHDOG_S = 60.0


class Requeued(SystemExit):
    """Raised on every rank once the job is requeued. A ``SystemExit``: submitit writes no result."""

    def __init__(self, reason: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.reason = reason


class Stopped(SystemExit):
    """Raised on every rank after a graceful stop that is not requeued (local run, requeues used
    up, job cancelled). A ``SystemExit``: no result file, the job does not count as a success."""

    def __init__(self, reason: str):
        super().__init__(STOP_EXIT_CODE)
        self.reason = reason


def job_identity() -> "tuple[str, int]":
    """(job id, attempt) of this process: submitit's job id (``<array>_<task>`` for arrays), else
    ``SLURM_JOB_ID`` / ``SUBMITIT_LOCAL_JOB_ID`` / ``ORCHESTRATOR_JOB_ID``, else ``pid-<pid>``; attempt = SLURM's restart count."""
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get(JOB_ID_VAR):  # torchrun's worker: the agent's job id
        return os.environ[JOB_ID_VAR], restart_count()  # (as runtime.start.job.whoami says it)
    job_id = None
    try:
        import submitit

        job_id = str(submitit.JobEnvironment().job_id)
    except Exception:  # not a submitit task
        job_id = (
            os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or os.environ.get(JOB_ID_VAR)
        )  # a job of torchrun agents (runtime.start.agent)
    return job_id or f"pid-{os.getpid()}", restart_count()


def global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is always there in the runtime
        pass
    for key in ("SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID", "RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return 0


def slurm_job_state(job_id: str) -> Optional[str]:
    """The job's SLURM state (:func:`orchestrator.slurm.slurm_state`, the one reader); None when SLURM cannot say."""
    state, _ = slurm_state(job_id)
    return None if state in (UNREADABLE, "UNKNOWN") else state


def slurm_restarts(job_id: str) -> Optional[int]:
    return restarts_of(scontrol_job(job_id))


def _ignore_sigterm() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def scontrol_requeue(job_id: str) -> "tuple[bool, str]":
    """``scontrol requeue job_id``: (requeued?, problem).

    SLURM answers a requeue by signalling every process of the job, ``scontrol`` included
    (seen: it died of SIGTERM, status -15, *after* the requeue was done). So scontrol runs with
    SIGTERM ignored, and a non-zero status is checked against the job's restart count.
    """
    if not job_id:
        return False, "SLURM_JOB_ID is not set"
    before = slurm_restarts(job_id)
    try:
        out = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, preexec_fn=_ignore_sigterm
        )
        if out.returncode == 0:
            return True, ""
        problem = f"`scontrol requeue {job_id}` failed: {out.stderr.strip() or out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = f"`scontrol requeue {job_id}` failed: {exc}"
    after = slurm_restarts(job_id)
    if before is not None and after is not None and after > before:
        return True, ""  # it did requeue; only the reply was lost
    return False, problem


def requeue_for_failure(run_dir: str, max_failures: int) -> "tuple[bool, str]":
    """After a failed attempt (its end already recorded): ``scontrol requeue`` this SLURM job when its
    failed attempts (hang, node failure, crash; this one included) are at most ``max_failures`` and it
    is still RUNNING. Returns (requeued?, one line saying why or why not). Local runs: never."""
    from orchestrator.ckpt.attempts import count_ended
    from orchestrator.ckpt.history import FAILURE_CAUSES, read_records

    if not on_slurm():
        return False, "not requeued (a local run)"
    job_id = slurm_job_id() or ""
    used = count_ended(read_records(run_dir), job_identity()[0], FAILURE_CAUSES)
    if used > max_failures:
        return False, f"not requeued: failure {used} > cluster.max_failures={max_failures}"
    state = slurm_job_state(job_id)
    if state is not None and state != "RUNNING":
        return False, f"not requeued: job {job_id} is {state}"
    ok, problem = scontrol_requeue(job_id)
    if not ok:
        return False, f"not requeued: {problem}"
    return True, f"requeued SLURM job {job_id} (failure {used} of at most {max_failures} retried)"


def leave_requeued(reason: str) -> None:
    """End this rank after another part of the job requeued it: no result file, bounded teardown."""
    flush_streams()
    if os.environ.get("SUBMITIT_EXECUTOR"):
        arm_exit_watchdog(REQUEUE_EXIT_CODE)
        destroy_process_groups()
    raise Requeued(reason)


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def destroy_process_groups() -> None:
    """Tear down megatron's groups and the default process group before exiting: a gloo group
    still alive at interpreter shutdown can abort the process ("terminate called without an
    active exception", exit -6) instead of the intended exit code."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort: the exit watchdog still bounds the shutdown
        pass


EXIT_HUNG = "interpreter shutdown hung"
"""What the exit watchdog's line says (in the task's log) when it had to end the process."""


def arm_exit_watchdog(code: int) -> None:
    """Make sure a submitit task ends even if interpreter shutdown hangs (a non-daemon thread
    left by a library): a daemon thread ``os._exit``s after a minute. Only armed inside submitit
    tasks, so a test that catches :class:`Stopped` in-process is not killed later."""

    def _kill() -> None:
        time.sleep(_EXIT_WATCHDOG_S)
        print(
            f"[orchestrator] warning: {EXIT_HUNG} for {_EXIT_WATCHDOG_S:.0f} s (a thread or child process left "
            f"behind); exiting with {code}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)

    threading.Thread(target=_kill, name="orchestrator-exit-watchdog", daemon=True).start()
