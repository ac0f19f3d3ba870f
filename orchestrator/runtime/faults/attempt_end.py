"""How a rank ends its attempt in the records: the first rank to claim the end records it, then the job decides.

:class:`AttemptEnd` is the part of :class:`~orchestrator.runtime.faults.guard.Guard` that writes the attempt's
end (``attempt_ended`` with its cause, ``history.claim_attempt_end`` making it once) and, after a failure, the
decision (restart in place, requeue, or neither: :func:`orchestrator.runtime.faults.inplace.decide`). It uses the
guard's fields: ``cfg``, ``run_dir``, ``rank``, ``host``, ``job_id``, ``attempt``, ``world_size``, ``iteration``,
``watchdog`` and ``born`` (this start's time). No torch import.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Tuple

from orchestrator.ckpt import history
from orchestrator.runtime.faults import inplace
from orchestrator.runtime.faults.numerics import quietly, say

_DECISION_WAIT_S = 30.0


def _print_traceback(exc: BaseException) -> None:
    import traceback

    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()


class AttemptEnd:
    """The attempt's end and the decision after a failure, for a :class:`~orchestrator.runtime.faults.guard.Guard`."""

    def _end(self, cause: str, message: str, **fields: Any) -> bool:
        if not history.claim_attempt_end(self.run_dir, self.job_id, self.attempt):
            return False
        quietly(
            lambda: history.record_attempt_ended(
                self.run_dir, self.job_id, self.attempt, cause, iteration=self.iteration, message=message, **fields
            )
        )
        return True

    def _requeue_failure(
        self, message: str, cause: str = "hang", failed_at: Optional[float] = None
    ) -> Tuple[bool, str]:
        """After a failure: restart in place, or the requeue policy (:func:`~orchestrator.runtime.faults.inplace.decide`)."""
        return inplace.decide(
            self.run_dir,
            self.job_id,
            self.attempt,
            self.cfg.cluster,
            message,
            since=self.born,
            world_size=self.world_size,
            failed_at=failed_at or time.time(),
            cause=cause,
            iteration=self.iteration,
        )

    def after_crash(self, exc: BaseException) -> None:
        """The first rank to claim the end records it (crashed or node failure: faults.lost) and decides on a
        requeue; the others wait for that decision (bounded) and leave requeued too, or let their exception go."""
        from orchestrator.runtime.faults.lost import crash_cause, report_alive
        from orchestrator.runtime.faults.requeue import leave_requeued
        from orchestrator.slurm import on_slurm

        failed_at, first = time.time(), (str(exc).strip().splitlines() or [""])[0][:300]  # (decided seconds later)
        message = f"rank {self.rank} ({self.host}) crashed at iteration {self.iteration}: {type(exc).__name__}: {first}"
        slurm = (
            on_slurm() or bool(inplace.agent_restarts())
        ) and self.watchdog is not None  # the heartbeats name hosts
        slurm = slurm and quietly(lambda: report_alive(self.run_dir, self.job_id, self.attempt, self.rank))
        if history.claim_attempt_end(self.run_dir, self.job_id, self.attempt):
            cause, message = crash_cause(
                self.run_dir,
                self.job_id,
                self.attempt,
                self.world_size,
                message,
                slurm,
                since=self.born,
                agent=bool(inplace.agent_restarts()),
            )
            history_ok = quietly(
                lambda: history.record_attempt_ended(
                    self.run_dir,
                    self.job_id,
                    self.attempt,
                    cause,
                    iteration=self.iteration,
                    message=message,
                    decided=False,
                )
            )
            requeued, detail = self._requeue_failure(message, cause, failed_at) if history_ok else (False, "")
            quietly(lambda: history.record_requeue_decision(self.run_dir, self.job_id, self.attempt, requeued, detail))
            if requeued or inplace.restart_decided() is not None:
                say(f"{message}; {detail}")
            if requeued:
                _print_traceback(exc)  # leaving requeued replaces the exception: keep its traceback in the log
                leave_requeued(message)
            return
        if not on_slurm() and not inplace.agent_restarts():  # never requeued nor restarted: nothing to wait for
            return
        decision = inplace.await_decision(self.run_dir, self.job_id, self.attempt, self.born, _DECISION_WAIT_S)
        if decision is not None and decision.get("requeued"):
            _print_traceback(exc)
            leave_requeued(message)

    def peer_died(self) -> bool:
        """Whether a signal ended a rank of this attempt since this start (its node's agent recorded it)."""
        from orchestrator.runtime.faults.lost import signalled_since

        return bool(quietly(lambda: signalled_since(self.run_dir, self.job_id, self.attempt, self.born)))

    def stopped_by_agent(self) -> None:
        """Its agent stopped this rank, blocked after a peer's death (:mod:`~orchestrator.runtime.faults.agent_stop`):
        the end a crash would have recorded, led by the rank that died."""
        self.after_crash(RuntimeError("blocked after a peer's death, stopped by its agent (SIGTERM)"))
