"""The timeout / preemption contract: signal -> save -> requeue -> resume.

Inside the job (every rank)::

    stop = StopRequest(max_requeues=cfg.cluster.max_num_timeout, run_dir=cfg.run.dir)
    stop.install()                      # at start, after torch.distributed is up or before: both work
    ...
    # at each iteration boundary:
    if stop.requested():                # collective: every rank must call it, every iteration
        save_checkpoint(...)            # collective save; the manifest is written last
        stop.requeue_or_exit("signal")  # never returns

What happens:

* SLURM sends ``USR2`` ``cluster.signal_delay_s`` before the time limit (``#SBATCH --signal=USR2@N``;
  the signal goes to every task of the step) and ``SIGTERM`` on preemption or ``scancel``. The
  handlers installed by :meth:`StopRequest.install` only set a flag: a signal can land in the
  middle of a collective, so the decision waits for the next iteration boundary.
* :meth:`StopRequest.requested` all-reduces the flag (MAX) so every rank stops after the *same*
  iteration, even when the signal reached ranks at different moments.
* :meth:`StopRequest.requeue_or_exit` synchronises the ranks (so the save is complete everywhere),
  then rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` when the job's attempts that ended in a
  timeout or preemption (``<run_dir>/jobs.jsonl``; without a run directory ``SLURM_RESTART_COUNT``)
  are fewer than ``max_requeues`` and the job is still ``RUNNING``; every rank then raises :class:`Requeued`
  (exit code :data:`REQUEUE_EXIT_CODE`). Otherwise — local runs, requeues used up, a cancelled
  job, a failed ``scontrol`` — every rank raises :class:`Stopped` (:data:`STOP_EXIT_CODE`).
  SLURM restarts the batch script from the top in the same job id; the run resumes from its
  latest checkpoint (auto-resume through the manifest check), and ``install()`` prints the
  restart count on rank 0. Rank 0 records the attempt's end (``timeout``, ``preempted`` or
  ``interrupted``, with the iteration) in the run's history (:mod:`orchestrator.ckpt.history`).
* A preemption (``PreemptMode=REQUEUE``, or ``scontrol requeue`` from outside): SLURM requeues the
  job itself and sends SIGTERM; its restart count is then above this attempt's, so the ranks save
  and leave requeued without asking again, cause ``preempted`` (counted against ``max_requeues``).
* Failures (a hang, a crash) are requeued by :func:`requeue_for_failure` against their own limit,
  ``cluster.max_failures``, counted the same way.

Why it works with submitit (verified against submitit 1.5.4, ``core/submission.py`` and
``core/job_environment.py``):

* submitit's ``process_job`` installs its own handlers (``USR2`` -> checkpoint-and-requeue, which
  for a callable without a ``checkpoint`` method raises ``UncompletedJobError`` on timeout and
  so writes an *error* result; ``SIGTERM`` -> log and ignore) **before** it calls the job
  function. ``install()`` runs inside the job function, so ours replace them.
* submitit writes ``<job>_<task>_result.pkl`` as ``("success", value)`` when the function returns
  and ``("error", traceback)`` when it raises an ``Exception``. A launcher (and ``Job.done()``)
  treats the first result file as the end of the job. :class:`Requeued` and :class:`Stopped` are
  ``SystemExit`` subclasses, which ``except Exception`` does not catch: **no result file is
  written**, so a requeued job leaves nothing a waiting launcher could read as success (or as
  failure), and after the restart the same result paths receive the real outcome.
* A ``scancel`` also delivers ``SIGTERM``, and ``scontrol requeue`` happily requeues a job in
  ``COMPLETING``/``CANCELLED`` state (seen on slurm 22.05). So the job's state is checked first:
  only a ``RUNNING`` job is requeued; a cancelled one stops.
* After ``scontrol requeue`` SLURM signals the tasks (``SIGTERM``, caught, harmless) and kills
  them after ``KillWait``; the ranks exit first. The requeued job becomes eligible again after
  SLURM's requeue delay (``cred_expire``, 120 s by default; the dev cluster sets 10 s).

Only this module's functions touch signals; torch is imported lazily inside the methods.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Optional

from orchestrator.runtime.faults.requeue import (  # noqa: F401 - re-exported: the signal path's names
    REQUEUE_EXIT_CODE,
    STOP_EXIT_CODE,
    Requeued,
    Stopped,
    global_rank,
    job_identity,
    leave_requeued,
    requeue_for_failure,
    slurm_job_state,
    slurm_restarts,
)
from orchestrator.runtime.faults.stop_exit import StopExit
from orchestrator.slurm import on_slurm, restart_count, slurm_job_id

_REQUESTED: dict = {}
"""A stop asked for from code (:func:`request_stop`): ``{"name": ...}``, and the installed StopRequest."""


def request_stop(name: str, cause: Optional[str] = None) -> None:
    """Ask this process's graceful stop from any thread (the watches of
    :mod:`orchestrator.runtime.faults.launcher`): the installed :class:`StopRequest` is triggered now,
    one installed later (during start-up) at its :meth:`~StopRequest.install`. ``cause``: a stop asked
    on purpose (``orchestrator stop``: ``by request``; a signal to the waiting launcher: ``interrupted``)
    is never requeued and its attempt ends with that cause."""
    _REQUESTED.setdefault("name", name)
    if cause:
        _REQUESTED.setdefault("cause", cause)
    current = _REQUESTED.get("current")
    if current is not None:
        current.trigger(name, cause)


def with_stop_signals_shielded(start: Any) -> Any:
    """``start()`` such that a process it spawns ignores USR2, SIGTERM and SIGINT for good, while this
    rank loses none of them. SLURM delivers the time-limit USR2 and scancel's SIGTERM to every
    process of the step, and a spawned helper starts with default dispositions: megatron's
    checkpoint-writer Manager died of USR2 and the next save failed with EOFError.

    The signals are blocked, then set to SIG_IGN (an ignored disposition survives exec; a spawned
    Python unblocks SIGINT/SIGTERM at start-up); after ``start()`` this rank's handlers come back
    first, then the mask, so a signal that arrived meanwhile (kept pending: Linux never discards a
    blocked signal) reaches the handler. Main thread only; elsewhere ``start()`` runs unshielded."""
    if threading.current_thread() is not threading.main_thread():
        return start()
    stops = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(stops))
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stops}
    try:
        return start()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class StopRequest(StopExit):
    """Signal flag + collective stop decision + requeue. One instance per process.

    ``max_requeues``: requeue while ``SLURM_RESTART_COUNT`` is below it (``cluster.max_num_timeout``).
    ``run_dir``: when given, rank 0 appends a ``requeued``/``stopped`` event to
    ``<run_dir>/jobs.jsonl`` (read by ``python -m orchestrator.status``).
    """

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, max_requeues: int = 0, run_dir: Optional[str] = None, log=None):
        self.max_requeues = int(max_requeues)
        self.run_dir = run_dir
        self._flag = False
        self.asked_cause: Optional[str] = None  # a stop asked on purpose (request_stop): never requeued
        self._preempted = False  # SLURM requeued the job itself (see _requeued_by_slurm)
        self.signal_name: Optional[str] = None
        self.signal_time: Optional[float] = None
        self._previous: dict = {}
        self._log = log or (lambda msg: print(f"[orchestrator] {msg}", file=sys.stderr, flush=True))

    # ---- signals ---------------------------------------------------------------------------
    def install(self) -> "StopRequest":
        """Register the flag-setting handler for USR2 and SIGTERM (replacing submitit's).

        Must run in the main thread (Python's rule for signal handlers). On rank 0 of a restarted
        SLURM job it prints the restart count.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopRequest.install() must be called from the main thread (signal handlers)")
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _REQUESTED["current"] = self
        if "name" in _REQUESTED:  # asked for before this request existed (request_stop)
            self.trigger(_REQUESTED["name"], _REQUESTED.get("cause"))
        if on_slurm() and global_rank() == 0:
            count = restart_count()
            if count:
                self._log(
                    f"SLURM job {slurm_job_id()} restarted: requeue {count} of at most {self.max_requeues} "
                    f"(SLURM_RESTART_COUNT={count})"
                )
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if _REQUESTED.get("current") is self:
            del _REQUESTED["current"]

    def training_done(self) -> None:
        """Training has ended normally: ignore ``USR2`` from now on, until the process exits.

        SLURM may send the time-limit warning while a job that just finished is tearing down
        (``--signal=USR2@N`` fires up to 60 s early). Python's finalization puts the default
        disposition back for signals with a Python handler, and ``USR2``'s default is to
        terminate: the task then dies of it after writing its success result and SLURM records
        the whole job as FAILED (exit code 140), seen on the dev cluster. ``SIG_IGN`` survives
        finalization. ``SIGTERM`` (scancel, preemption) keeps ending the process.
        """
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def _handle(self, signum: int, frame: Any = None) -> None:  # signal handler: set a flag, nothing else
        if not self._flag:
            self.signal_name = signal.Signals(signum).name
            self.signal_time = time.time()
        self._flag = True

    def trigger(self, name: str = "manual", cause: Optional[str] = None) -> None:
        """Request a stop from code (tests, the stop request of :mod:`orchestrator.ckpt.stop`, ...);
        ``cause``: asked on purpose (see :func:`request_stop`)."""
        if not self._flag or (cause and not self.asked_cause):
            self.signal_name, self.signal_time = name, time.time()
        self.asked_cause = self.asked_cause or cause
        self._flag = True

    @property
    def local_flag(self) -> bool:
        """Whether this process received a stop signal (no communication)."""
        return self._flag

    # ---- collective decision ---------------------------------------------------------------
    def requested(self, group=None) -> bool:
        """True on every rank when any rank received a signal (all-reduce MAX over ``group``).

        Collective when torch.distributed is initialised: every rank must call it at the same
        point. Without a process group it is the local flag.
        """
        local = self._flag
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return local
        device = "cpu"
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        result = bool(flag.item())
        if result and not local:
            self.trigger("peer")  # another rank got the signal; remember it for requeue_or_exit
        return result

    def _all_max(self, value: int, group=None) -> int:
        """MAX of ``value`` over the ranks (a barrier too); ``value`` without a process group."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return value
        device = "cpu"
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    # ---- requeue or stop -------------------------------------------------------------------
    def _decide(self) -> "tuple[bool, str]":
        """(requeue?, why) — evaluated on rank 0."""
        if self.asked_cause:
            return False, "asked on purpose: not requeued"
        if not on_slurm():
            return False, "not a SLURM job (local run): stopped after saving"
        job_id = slurm_job_id()
        if not job_id:
            return False, "SLURM_JOB_ID is not set"
        count = restart_count()
        if self.run_dir:
            from orchestrator.ckpt.attempts import count_ended
            from orchestrator.ckpt.history import TIMEOUT_CAUSES, read_records

            count = count_ended(read_records(self.run_dir), job_identity()[0], TIMEOUT_CAUSES)
        if count >= self.max_requeues:
            return False, (
                f"requeues used up: {count} timeout/preemption requeue(s) >= cluster.max_num_timeout="
                f"{self.max_requeues}"
            )
        state = slurm_job_state(job_id)
        if state is not None and state != "RUNNING":
            return False, (
                f"job {job_id} is {state} (cancelled, or its time limit passed before this stop was "
                f"done: start-up and save took longer than cluster.signal_delay_s), not requeued"
            )
        return True, f"requeue {count + 1} of at most {self.max_requeues}"

    def _requeued_by_slurm(self) -> bool:
        """Whether SLURM itself has requeued this job since the attempt started (a preemption with
        ``PreemptMode=REQUEUE``, or ``scontrol requeue`` from outside: the SIGTERM came with it)."""
        if not on_slurm() or not slurm_job_id():
            return False
        restarts = slurm_restarts(slurm_job_id() or "")
        return restarts is not None and restarts > restart_count()
