"""The launcher's side of warm ranks: start one pool job, hand it trials, read their results.

    launcher = PoolLauncher(pool_root)              # sweep driver / tune, once (submit.pool_launcher)
    summary = launcher(cfg, layout, prepared)       # instead of submit.executor.launch, per trial
    launcher.close()                                # a stop file; the ranks exit

:class:`~orchestrator.submit.pool_launcher.PoolLauncher` keeps one :class:`WarmPool` (a submitit job running
:class:`~orchestrator.runtime.start.pool.PoolJob` on every rank, local or one SLURM allocation) while
consecutive trials share the pool's key (world size, device, backend, cluster and rank
environment); a trial with another key closes it and starts another. A failed trial (a rank's
error file, a rank that died, the job gone, the trial's time bound) cancels the pool and raises
:class:`~orchestrator.errors.JobFailedError` with the failing rank's last lines; the next trial
starts a fresh pool. Each trial is recorded in its own run's ``jobs.jsonl`` under the pool's job id.
No torch import.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig, from_dict, to_dict
from orchestrator.errors import JobFailedError, SubmissionError, ranks_died
from orchestrator.io import write_atomic

POOL_JOB_DAYS = 7
"""A local pool job's own time limit (each trial is bounded by the launcher, :meth:`WarmPool.run`)."""


_PER_TRIAL = ("timeout_min", "wait", "poll_interval_s", "max_num_timeout", "max_failures", "signal_delay_s")
"""Cluster options a trial may change without new ranks (the launcher applies them per trial)."""


def pool_key(cfg: JobConfig, world_size: int) -> Tuple[Any, ...]:
    """What trials of one pool must share: ranks, device, backend, where and how the ranks run
    (every ``cluster`` option but :data:`_PER_TRIAL`)."""
    cluster = {k: v for k, v in dataclasses.asdict(cfg.cluster).items() if k not in _PER_TRIAL}
    return (
        world_size,
        cfg.training.device,
        cfg.parallelism.distributed_backend,
        cfg.training.distributed_timeout_minutes,
        json.dumps(cluster, sort_keys=True, default=str),
    )


class WarmPool:
    """One pool job: ``world_size`` warm ranks reading trial files from ``pool_dir``."""

    def __init__(self, cfg: JobConfig, world_size: int, pool_dir: Path, allocation_min: Optional[int] = None):
        from orchestrator.runtime.faults.launcher import launcher_identity
        from orchestrator.runtime.start.pool import PoolJob
        from orchestrator.submit.executor import children_ignore_sigint, forks_ranks, job_environment, make_executor

        self.key, self.world_size, self.dir = pool_key(cfg, world_size), world_size, Path(pool_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        own = from_dict(to_dict(cfg))  # the pool's job: its own folder and time limit
        own.run.dir = str(self.dir)
        own.cluster.timeout_min = allocation_min or (
            POOL_JOB_DAYS * 24 * 60 if cfg.cluster.kind == "local" else cfg.cluster.timeout_min
        )
        self.cfg = own
        # Local: one task imports torch and megatron-core once and forks the other ranks (PoolJob.fork_ranks)
        self.forked = forks_ranks(cfg, world_size)
        executor = make_executor(own, 1 if self.forked else world_size)
        payload = PoolJob(
            str(self.dir),
            job_environment(own, world_size),
            launcher_identity(),
            fork_ranks=world_size if self.forked else 0,
        )
        try:
            with children_ignore_sigint():
                self.job = executor.submit(payload)
        except Exception as exc:
            raise SubmissionError(
                f"submission of warm ranks to cluster.kind={cfg.cluster.kind} failed: {exc}"
            ) from None
        self.next, self.alive, self.seen_all = 0, True, False
        print(
            f"[orchestrator] warm ranks: job {self.job.job_id} ({cfg.cluster.kind}), {world_size} ranks, "
            f"trials in {self.dir}",
            flush=True,
        )

    def run(self, cfg: JobConfig, layout: ParallelLayout, prepared, timeout_s: float, progress=None) -> Dict[str, Any]:
        """Run one trial; the logging rank's summary (with ``job_id`` and ``trial_wall_s``, the
        launcher's seconds from handing the trial over to reading its result).

        Raises JobFailedError (pool cancelled) when the trial fails or exceeds ``timeout_s``."""
        from orchestrator.ckpt.history import record_submission
        from orchestrator.runtime.start.pool import result_path, trial_path

        num, started = self.next, time.time()
        self.next, self.seen_all = self.next + 1, False
        record_submission(
            cfg.run.dir,
            str(self.job.job_id),
            cfg.cluster,
            {"stdout": str(self.job.paths.stdout), "stderr": str(self.job.paths.stderr)},
            num_tasks=self.world_size,
            warm_pool=str(self.dir),
            trial=num,
        )
        write_atomic(
            trial_path(self.dir, num),
            json.dumps(
                {
                    "config": to_dict(cfg),
                    "layout": dataclasses.asdict(layout),
                    "prepared": dataclasses.asdict(prepared),
                    "time": started,
                },
                default=str,
            ),
        )
        try:
            while True:
                if progress is not None:
                    progress.poll()
                try:
                    summaries = json.loads(result_path(self.dir, num).read_text())["summaries"]
                except (OSError, ValueError, KeyError):
                    summaries = None
                if summaries is not None:
                    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), summaries[-1])
                    return dict(best, job_id=str(self.job.job_id), trial_wall_s=time.time() - started)
                self._check(num, started, timeout_s)
                time.sleep(0.05)
        except PoolEnded:
            self.alive = False
            raise
        except BaseException as exc:
            from orchestrator.submit import outcome

            self.close(interrupted=True) if isinstance(exc, KeyboardInterrupt) else self.cancel()
            cause = "interrupted" if isinstance(exc, KeyboardInterrupt) else "crashed"
            why = "the launcher was interrupted (Ctrl-C or a signal)" if cause == "interrupted" else str(exc)
            outcome.record_end(cfg.run.dir, str(self.job.job_id), cause, why)  # unless the trial recorded it
            raise
        finally:
            if progress is not None:
                progress.poll()
                progress.close()

    def _check(self, num: int, started: float, timeout_s: float) -> None:
        """Raise JobFailedError when trial ``num`` failed, a rank died, the job ended or time ran out."""
        from orchestrator.runtime.start.pool import error_path, result_path

        job_id = self.job.job_id
        errors = sorted(r for r in range(self.world_size) if error_path(self.dir, num, r).exists())
        if errors:
            time.sleep(1.0)  # the first error is often a peer's broken collective: let the cause land too
            errors = sorted(r for r in range(self.world_size) if error_path(self.dir, num, r).exists())
            tails = {r: error_path(self.dir, num, r).read_text(errors="replace").rstrip().splitlines() for r in errors}
            root = min(
                errors, key=lambda r: ("ProcessGroup" in "\n".join(tails[r]) or "Connection" in "\n".join(tails[r]), r)
            )
            killed = self._killed(num)  # a rank killed by a signal breaks its peers' collectives: it is the cause
            if killed:
                raise JobFailedError(
                    f"job {job_id}: warm {ranks_died(killed, '; '.join(sorted(set(killed.values()))))} in trial "
                    f"{num}; its peers' errors followed: {tails[root][-1] if tails[root] else ''}\n"
                    f"logs: {Path(self.job.paths.stderr).parent}/"
                )
            raise JobFailedError(
                f"job {job_id}: rank {root} failed in warm trial {num}:\n"
                + "\n".join(tails[root][-15:])
                + f"\nlogs: {Path(self.job.paths.stderr).parent}/"
            )
        if self.cfg.cluster.kind == "local":
            alive = self._alive_ranks(num)
            if alive is None and not self.seen_all and not result_path(self.dir, num).exists():
                raise PoolEnded(f"job {job_id}: the warm ranks' job had ended before trial {num} started")
            self.seen_all = self.seen_all or (alive is not None and len(alive) == self.world_size)
            if self.seen_all and (alive is None or len(alive) < self.world_size):
                dead = sorted(set(range(self.world_size)) - (alive or set()))
                raise JobFailedError(
                    f"job {job_id}: warm {ranks_died(dead, '; '.join(sorted(set(self._killed(num).values()))))} "
                    f"in trial {num}\n"
                    f"logs: {Path(self.job.paths.stderr).parent}/"
                )
        elif self._slurm_ended():
            raise JobFailedError(
                f"job {job_id}: the warm ranks' allocation ended during trial {num}\n"
                f"logs: {Path(self.job.paths.stderr).parent}/"
            )
        if time.time() - started > timeout_s:
            raise JobFailedError(
                f"job {job_id}: warm trial {num} ran past its bound of {timeout_s:.0f} s "
                f"(cluster.timeout_min={self.cfg.cluster.timeout_min}); cancelled"
            )

    def _killed(self, num: int) -> Dict[int, str]:
        """The forked warm ranks of trial ``num`` that a signal ended, ``{rank: "exit by signal 9, SIGKILL"}``, read
        from their zombies (:func:`~orchestrator.runtime.start.forked.zombie_signal`) as for a job's forked ranks."""
        from orchestrator.runtime.start.forked import zombie_signal
        from orchestrator.runtime.start.pool import pid_path

        killed = {}
        for rank in range(self.world_size) if self.forked else ():
            try:
                killed[rank] = zombie_signal(int(pid_path(self.dir, num, rank).read_text()))
            except (OSError, ValueError):
                continue
        return {rank: line for rank, line in killed.items() if line}

    def _alive_ranks(self, num: int) -> Optional[set]:
        """Local ranks of trial ``num`` whose process is alive (None: the job's controller is gone). Forked
        ranks are found by their pid files (:func:`~orchestrator.runtime.start.pool.pid_path`), others as
        submitit tasks."""
        from orchestrator.submit.liveness import local_alive_ranks

        if not self.forked:
            return local_alive_ranks(self.job)
        import psutil

        from orchestrator.runtime.start.pool import pid_path

        if self._ended():
            return None
        alive = set()
        for rank in range(self.world_size):
            try:
                proc = psutil.Process(int(pid_path(self.dir, num, rank).read_text()))
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.add(rank)
            except (OSError, ValueError, psutil.NoSuchProcess):
                pass
        return alive

    def _ended(self) -> bool:
        if self.cfg.cluster.kind == "local":
            process = getattr(self.job, "_process", None)
            return process is None or process.poll() is not None
        return self._slurm_ended()

    def _slurm_ended(self) -> bool:
        from orchestrator.slurm import slurm_state
        from orchestrator.submit.jobs import SLURM_ENDED

        if time.time() - getattr(self, "_polled", 0.0) < 5.0:
            return False
        self._polled = time.time()
        return slurm_state(str(self.job.job_id))[0] in SLURM_ENDED

    def cancel(self) -> None:
        from orchestrator.submit.stop import cancel

        self.alive = False
        cancel(self.job, self.cfg)

    def stop(self) -> None:
        """Write the stop file (once): each rank exits after its current trial."""
        from orchestrator.runtime.start.pool import trial_path

        if self.alive and not getattr(self, "_stopped", False):
            self._stopped = True
            write_atomic(trial_path(self.dir, self.next), json.dumps({"stop": True}))

    def close(self, timeout_s: float = 30.0, interrupted: bool = False) -> None:
        """Ask the ranks to exit (a stop file) and wait for them; cancel them after ``timeout_s``. ``interrupted``
        (a signal to the launcher): local ranks are cancelled at once; a SLURM job is never cancelled by a signal
        (:mod:`orchestrator.submit.signals`): its ranks exit after their current trial, said in one line."""
        if not self.alive:
            return
        self.stop()
        self.alive = False
        if interrupted:
            if self.cfg.cluster.kind == "local":
                return self.cancel()
            from orchestrator.submit.signals import tell

            return tell(
                f"[orchestrator] warm ranks' SLURM job {self.job.job_id} not cancelled: its ranks exit after their "
                f"current trial (scancel {self.job.job_id} ends it now)"
            )
        # Every rank has returned once its result file exists; the interpreters' own exit (seconds with
        # torch loaded) is not waited for.
        results = [Path(self.job.task(r).paths.result_pickle) for r in range(1 if self.forked else self.world_size)]
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if all(p.exists() for p in results) or self._ended():
                return
            time.sleep(0.05)
        self.cancel()


class PoolEnded(JobFailedError):
    """The warm ranks' job had ended before a trial was picked up (nothing of it ran): the trial may run again."""
