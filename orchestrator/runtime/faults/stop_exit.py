"""The end of a stopped attempt: requeue (rank 0, when asked and allowed), the record, the exit. Mixed into
:class:`~orchestrator.runtime.faults.preempt.StopRequest`, which installs the signal handlers and decides."""

from __future__ import annotations

import os
from typing import Optional

from orchestrator.runtime.faults.requeue import (
    REQUEUE_EXIT_CODE,
    STOP_EXIT_CODE,
    Requeued,
    Stopped,
    arm_exit_watchdog,
    destroy_process_groups,
    flush_streams,
    global_rank,
    job_identity,
    scontrol_requeue,
)
from orchestrator.slurm import on_slurm, restart_count, slurm_job_id


class StopExit:
    """How a stop ends the rank: rank 0 requeues the SLURM job when the stop asks for it and it may, every rank records
    the attempt's end once (``stopped``, ``timeout``, ``preempted``) and exits with the requeue or stop code."""

    def requeue_or_exit(self, reason: str = "", group=None, iteration: Optional[int] = None) -> None:
        """Requeue the SLURM job (rank 0) and exit every rank; never returns.

        Call on every rank after the checkpoint is saved. Raises :class:`Requeued` or
        :class:`Stopped` (``SystemExit`` subclasses: submitit writes no result file). ``iteration``
        (the one just saved; default: the running guard's last beat) goes into the attempt's record.
        """
        rank = global_rank()
        why = "stop asked" if self.asked_cause else reason or "stop requested"
        if self.signal_name:
            why += f" ({self.signal_name})"
        # 1. every rank has saved and arrived; rank 0 says whether it will requeue
        # (2: SLURM requeued the job itself, a preemption: it restarts it, nothing to ask)
        want = 0
        detail = ""
        if rank == 0:
            if self._requeued_by_slurm() and not self.asked_cause:
                want, detail = 2, f"SLURM requeued job {slurm_job_id()} itself (preemption)"
            else:
                want, detail = self._decide()
                want = int(want)
        want = self._all_max(want, group)
        # 2. rank 0 requeues; 3. everybody learns whether that worked
        done = int(want == 2)
        self._preempted = want == 2
        if rank == 0 and want == 1:
            ok, problem = scontrol_requeue(slurm_job_id() or "")
            done = int(ok)
            if problem:
                detail = problem
        done = self._all_max(done, group) if want == 1 else done
        event = "requeued" if done else "stopped"
        if rank == 0:
            self._log(
                f"{why}: checkpoint saved; {event} SLURM job {slurm_job_id()}: {detail}"
                if on_slurm()
                else f"{why}: checkpoint saved; {event}: {detail}"
            )
            self._record(event, why, detail, iteration)
        flush_streams()
        if os.environ.get("SUBMITIT_EXECUTOR"):  # a submitit task: this process must end now
            arm_exit_watchdog(REQUEUE_EXIT_CODE if done else STOP_EXIT_CODE)
            destroy_process_groups()
        if done:
            raise Requeued(f"{why}: {detail}")
        raise Stopped(f"{why}: {detail}")

    def _record(self, event: str, why: str, detail: str, iteration: Optional[int] = None) -> None:
        if not self.run_dir:
            return
        try:
            from orchestrator.ckpt import history

            job_id, attempt = job_identity()
            history.record_event(
                self.run_dir,
                event,
                job_id=job_id,
                restart_count=restart_count(),
                reason=why,
                detail=detail,
                signal=self.signal_name,
            )
            if iteration is None:
                from orchestrator.runtime.faults import guard

                iteration = guard.last_iteration()
            requeued = event == "requeued"
            cause = (
                self.asked_cause
                if self.asked_cause and not requeued
                else "preempted"
                if self._preempted
                else "timeout"
                if self.signal_name == "SIGUSR2" or (requeued and self.signal_name != "SIGTERM")
                else "preempted"
                if requeued
                else "interrupted"
            )
            if history.claim_attempt_end(self.run_dir, job_id, attempt):
                history.record_attempt_ended(
                    self.run_dir,
                    job_id,
                    attempt,
                    cause,
                    iteration=iteration,
                    message=f"{why}: {event}" + (f" ({detail})" if detail else ""),
                    requeued=requeued,
                )
        except Exception as exc:  # never let bookkeeping block the exit
            self._log(f"could not record the {event} event: {exc}")
