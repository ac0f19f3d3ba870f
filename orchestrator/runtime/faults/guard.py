"""The training loop's guard: NaN/inf stop (or skip), hang watchdog heartbeat, save faults, attempt records.

In every rank, around the loop (``runtime.train`` / ``runtime.loop``)::

    guard = Guard(cfg, run_dir, rank, host)          # heartbeat + watchdog thread; rank 0: attempt_started
    ...
    update_ok, grad_norm, _ = guard.step(optimizer)  # optional: optimizer.step() that never applies a
                                                     # non-finite update and always yields the grad norm
    guard.check(iteration, lm_loss, grad_norm)       # BEFORE any save of that iteration
    with guard.saving(iteration):                    # a save counts as progress; ENOSPC -> DiskFullError
        saver(iteration, consumed)
    guard.beat(iteration)                            # after every iteration: memory only
    ...
    guard.close()                                    # at the end, also from a ``finally``

NaN/inf (``training.nan_policy``). The decision uses the *global* gradient norm: megatron reduces it
over the model-parallel group (and DP replicas hold identical gradients after their all-reduce), so
every rank sees the same value and stops at the same iteration without an extra collective. Only
on the failure path one ``all_gather`` tells which ranks hold a non-finite loss or gradients.

* ``stop`` (default): :class:`~orchestrator.errors.NonFiniteLossError` on every rank, naming the
  iteration, the value and the ranks; the loop raises before anything of that iteration is saved,
  so the latest checkpoint stays the last good one. The attempt ends with cause ``nan``.
* ``skip``: megatron-core 0.16.1's fp32 and bf16 optimizers have no inf/NaN check
  (``FP32Optimizer.step``: ``prepare_grads`` returns False, the clip coefficient of a NaN norm
  compares False, and ``step_with_ready_grads`` applies the update); only fp16's loss scaler skips
  (``found_inf``). Megatron-LM itself stops on a NaN loss (``rerun_state_machine.validate_result``
  with ``fatal=True``). So a step can be skipped honestly only *before* the update:
  :meth:`Guard.step` runs megatron's own sequence (``prepare_grads`` → ``get_grad_norm`` → clip →
  ``step_with_ready_grads``) and leaves out the last two for a non-finite norm. Weights and
  optimizer moments are then untouched; the loop should not advance the LR schedule for a step
  with ``update_ok=False`` (Megatron-LM's rule). Up to ``training.max_skipped_steps`` consecutive
  skips, then stop. A loop that calls ``optimizer.step()`` itself has already applied the update:
  with ``skip`` it is then stopped, saying so.
* ``optimizer.clip_grad=0``: megatron returns no grad norm. :meth:`Guard.step` computes it anyway
  (the same reduction clipping would do); without it :meth:`check` falls back to one MAX all-reduce
  of a "this rank's loss is non-finite" flag per iteration.

Hangs: :class:`~orchestrator.runtime.faults.watchdog.Watchdog` (``training.hang_timeout_s``). Saves:
:meth:`Guard.saving` (:func:`~orchestrator.runtime.faults.diskspace.explain_save_failure`). Torch is imported inside the methods that need it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from orchestrator.ckpt import attempts, history
from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
from orchestrator.errors import DiskFullError, NonFiniteLossError, OrchestratorError
from orchestrator.runtime.faults import agent_stop, inplace
from orchestrator.runtime.faults.attempt_end import AttemptEnd
from orchestrator.runtime.faults.diskspace import explain_save_failure
from orchestrator.runtime.faults.numerics import NumericsGuard, quietly
from orchestrator.runtime.faults.watchdog import Watchdog

__all__ = ["Guard", "explain_save_failure", "last_iteration"]

_ACTIVE: Optional["Guard"] = None


def last_iteration() -> Optional[int]:
    """The last iteration the running guard of this process was told about (None without one)."""
    return _ACTIVE.iteration if _ACTIVE is not None else None


class Guard(NumericsGuard, AttemptEnd):
    """One per rank. ``Guard(cfg, run_dir, rank, host)`` starts the heartbeat and the watchdog thread
    (unless ``training.hang_timeout_s`` is null) and, on rank 0, records ``attempt_started``.

    ``host``: this rank's host name (None: this machine's). ``world_size`` defaults to
    torch.distributed's; ``start_iteration``: the iteration training starts from (for the record).
    """

    def __init__(
        self,
        cfg,
        run_dir,
        rank: int,
        host: Optional[str] = None,
        *,
        world_size: Optional[int] = None,
        start_iteration: Optional[int] = None,
    ):
        global _ACTIVE
        from orchestrator.runtime.faults.requeue import job_identity

        self.cfg, self.run_dir, self.rank = cfg, str(run_dir), int(rank)
        self.host = host or socket.gethostname()
        self.job_id, self.attempt = job_identity()
        self.world_size = world_size or _world_size()
        t = cfg.training
        self.policy, self.max_skipped = t.nan_policy, int(t.max_skipped_steps)
        self.skipped_in_row = self.skipped_total = 0
        self.iteration: Optional[int] = start_iteration
        self._step_state: Optional[str] = None  # set by step(): applied | skipped | overflow
        self._optimizer: Any = None
        self._closed = False
        self.watchdog: Optional[Watchdog] = None
        self.born, self._restart = time.time(), {}  # rank 0 of ranks restarted in place: restart number, failure
        if t.hang_timeout_s:
            self.watchdog = Watchdog(
                self.run_dir,
                self.rank,
                self.world_size,
                self.host,
                self.job_id,
                self.attempt,
                float(t.hang_timeout_s),
                on_hang=self._requeue_failure,
                restart=inplace.restart_number(self.run_dir, self.job_id, self.attempt)[0]
                if inplace.agent_restarts()
                else 0,
            ).start()
        if inplace.agent_restarts():  # stopped by its agent while blocked after a peer's death: end as a crash
            agent_stop.watch(lambda: self._closed, self.peer_died, self.stopped_by_agent)
        _ACTIVE = self
        if start_iteration is not None:
            self.begin(start_iteration)

    def begin(self, start_iteration: int) -> None:
        """Training starts after iteration ``start_iteration`` (0, or the checkpoint resumed): rank 0
        records the attempt's start (``status`` reads the total there). The watchdog has been running
        since the guard was made (before the model build and the first collective), so a rank that stops
        during the start-up or the checkpoint load is named too."""
        self.iteration = start_iteration
        if self.rank == 0:
            quietly(lambda: history.clear_attempt_markers(self.run_dir, self.job_id, self.attempt))
            quietly(lambda: self._restart.update(inplace.record_restart_start(self.run_dir, self.job_id, self.attempt)))
            quietly(
                lambda: history.record_attempt_started(
                    self.run_dir,
                    self.job_id,
                    self.attempt,
                    iteration=start_iteration,
                    host=self.host,
                    world_size=self.world_size,
                    train_iters=self.cfg.training.train_iters,
                    **self._restart,
                )
            )

    # ---- per iteration ---------------------------------------------------------------------------
    def beat(self, iteration: int) -> None:
        """Iteration ``iteration`` finished on this rank (memory only: no syscall, no collective)."""
        self.iteration = iteration
        if self.watchdog is not None:
            self.watchdog.progress(iteration)
        if self._restart:  # the first iteration after an in-place restart: one record, once
            started, self._restart = self._restart, {}
            quietly(lambda: inplace.record_resumed(self.run_dir, (self.job_id, self.attempt), started, iteration))

    # ---- saves and phases ------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, allowance_s: Optional[float] = None) -> Iterator[None]:
        """A stretch without iterations (evaluation, a save) that counts as progress when it starts and
        ends, allowed ``allowance_s`` (default ``training.hang_timeout_s``) in between."""
        if self.watchdog is None:
            yield
            return
        with self.watchdog.phase_of(name, allowance_s or self.watchdog.timeout_s):
            yield

    @contextlib.contextmanager
    def saving(self, iteration: int) -> Iterator[None]:
        """Wrap the save of ``iteration``: allowed ``checkpoint.save_timeout_s`` + 60 s by the watchdog;
        a disk-full failure becomes one :class:`DiskFullError` naming ENOSPC, the path and the free space."""
        path = Path(self.run_dir) / CHECKPOINTS_DIR / f"iter_{iteration:07d}"
        try:
            with self.phase("save", float(self.cfg.checkpoint.save_timeout_s) + 60.0):
                yield
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # torch's CheckpointException (a failed synchronous save) is no Exception
            explained = explain_save_failure(exc, path)
            if explained is None:
                raise
            raise explained from exc

    # ---- history for manifests -------------------------------------------------------------------
    def history(self, iteration: int) -> List[Dict[str, Any]]:
        """This run's attempts for a manifest saved at ``iteration`` (this attempt: still running, or
        ``completed`` when ``iteration`` is the last)."""
        return attempts.history_for_manifest(
            self.run_dir, iteration, self.cfg.training.train_iters, current=(self.job_id, self.attempt)
        )

    # ---- the end ---------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Stop the watchdog, record nothing: the job failed before :meth:`begin` (its error is
        reported by whoever catches it)."""
        global _ACTIVE
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if _ACTIVE is self:
            _ACTIVE = None

    def close(self) -> None:
        """Stop the watchdog and record how this attempt ended. Safe to call from a ``finally``: the
        exception in flight decides the cause (none: completed, or exited before train_iters). After
        a crash on SLURM with ``cluster.max_failures`` left, the job is requeued and every rank leaves
        through :class:`~orchestrator.runtime.faults.preempt.Requeued` (no error result)."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        exc = sys.exc_info()[1]
        if self.watchdog is not None:
            self.watchdog.stop()
        if _ACTIVE is self:
            _ACTIVE = None
        if exc is None:
            if self.rank == 0:
                done = self.iteration is not None and self.iteration >= self.cfg.training.train_iters
                self._end("completed" if done else "exited", "")
        elif isinstance(exc, KeyboardInterrupt):
            self._end("interrupted", "interrupted (Ctrl-C or SIGINT)")
        elif isinstance(exc, (SystemExit, NonFiniteLossError)):
            pass  # recorded where it was raised (preempt, check)
        elif isinstance(exc, DiskFullError):
            self._end("disk full", f"rank {self.rank} ({self.host}): {exc}")
        elif isinstance(exc, OrchestratorError):
            self._end("crashed", f"rank {self.rank} ({self.host}): {exc}")  # user-fixable: never retried
        else:
            self.after_crash(exc)


# ---- helpers -------------------------------------------------------------------------------------


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


STARTUP_FREEZE_ENV = "ORCHESTRATOR_TEST_FREEZE_AT_STARTUP"
"""Test-only: the rank it names stops itself (SIGSTOP) at the start of its start-up (:func:`startup_fault`)."""


def startup_fault(rank: int) -> None:
    """Where :data:`STARTUP_FREEZE_ENV` names ``rank``: stop this process (SIGSTOP: every thread of it, the
    watchdog's too) before its model build and first collective, as a frozen or stopped process would; its
    peers then wait in the rendezvous until the hang watchdog names it. Nothing otherwise."""
    import os
    import signal

    if os.environ.get(STARTUP_FREEZE_ENV) == str(rank):
        os.kill(os.getpid(), signal.SIGSTOP)
