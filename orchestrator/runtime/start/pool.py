"""Warm ranks: one job whose rank processes train trial after trial (sweep points, tune trials).

A fresh job pays its whole start-up for every trial: N processes start Python, import torch and
megatron-core, rendezvous and join the process group (10-30 s on a busy 2-core machine, for a
trial that trains for 5). :class:`PoolJob` is submitted once, like a training job (submitit,
one task per rank, local or one SLURM allocation); each rank imports what training needs, then
loops over trial files in the pool directory (the launcher's :class:`~orchestrator.submit.pool.WarmPool`
writes them):

    <pool>/trial_<n>.json             {"config", "prepared", "time"} or {"stop": true}
    <pool>/trial_<n>.result.json      rank 0: every rank's summary (by global rank)
    <pool>/trial_<n>.rank<r>.error    a rank's exception, before the rank exits

Per trial, each rank takes the trial's run lock as a job does, frees what the last trial left and
resets its peak memory (:func:`~orchestrator.runtime.training.summary.reset_peak_memory`), then runs
:func:`orchestrator.runtime.training.run.run` with ``keep_process_group=True``: megatron's parallel state,
seeds, model, optimizer and datasets are built from the trial's config exactly as in a fresh job
(same losses, tested), only the default process group is kept. Trials must share the world size,
device and backend (the launcher starts another pool otherwise).

A failing trial ends the pool: the failing rank writes its error file and raises, so its task
fails like a job's rank; the launcher cancels the rest and starts a fresh pool for the next trial
(a rank that raised may have left its peers inside a collective). The pool also ends on a ``stop``
file, when the launcher's process is gone (same host), or after :data:`IDLE_TIMEOUT_S` without a
trial.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Optional

from orchestrator.runtime.faults.launcher import launcher_alive, watch_launcher
from orchestrator.runtime.faults.preempt import request_stop

IDLE_TIMEOUT_S = 900.0
"""A warm rank with no trial for this long exits (its launcher died without a stop file)."""
POLL_S = 0.05


def trial_path(pool_dir: "str | os.PathLike", num: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.json"


def result_path(pool_dir: "str | os.PathLike", num: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.result.json"


def error_path(pool_dir: "str | os.PathLike", num: int, rank: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.rank{rank}.error"


def _next_trial(pool_dir: Path, num: int, owner: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``num``-th trial file (None: stop, launcher gone, or idle too long)."""
    path, deadline, checked = trial_path(pool_dir, num), time.monotonic() + IDLE_TIMEOUT_S, time.monotonic()
    while time.monotonic() < deadline:
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):  # not there yet (the launcher writes it atomically)
            spec = None
        if spec is not None:
            return None if spec.get("stop") else spec
        if time.monotonic() - checked > 2.0:
            if not launcher_alive(owner):
                return None
            checked = time.monotonic()
        time.sleep(POLL_S)
    return None


def _sample_indices(cfg, prepared, rank: int, timeout_s: float = 1800.0) -> None:
    """The trial's GPTDataset sample indices, built once: rank 0 builds what the cache lacks (the launcher
    of a warm pool does not), the others wait for its marker (every rank then loads them)."""
    from orchestrator.data.prepare import indices_cached
    from orchestrator.runtime.rank.dataset import cache_indices

    if rank == 0:
        cache_indices(cfg, prepared)
        return
    deadline = time.monotonic() + timeout_s
    while not indices_cached(cfg, prepared):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not build the sample indices within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def pid_path(pool_dir: "str | os.PathLike", num: int, rank: int) -> Path:
    """The process id of rank ``rank`` of trial ``num`` in a local pool (the launcher checks it is alive)."""
    return Path(pool_dir) / f"trial_{num}.rank{rank}.pid"


class PoolJob:
    """``PoolJob(pool_dir, env, owner, fork_ranks)()``: warm ranks; returns how many trials ran.

    ``env`` is applied before torch is imported (as :class:`~orchestrator.runtime.start.job.TrainJob`);
    ``owner``: the launcher's ``{"host", "pid", "pid_created"}``.

    * ``fork_ranks`` = N > 1 (local pools): the job has one task, which imports torch and megatron-core
      once and then, for every trial, forks N fresh rank processes from itself (copy-on-write; it never
      starts a process group or a thread pool of its own, so every fork is clean). Each trial thus runs
      in new processes -- its own process group, memory and peak, exactly a fresh job's -- without the
      ~3 CPU-s import per rank (:mod:`orchestrator.runtime.start.forked`).
    * otherwise (SLURM: one allocation): each task is a rank that serves every trial itself, keeping the
      default process group between trials (``train.run(keep_process_group=True)``).
    """

    def __init__(
        self,
        pool_dir: str,
        env: Optional[Dict[str, str]] = None,
        owner: Optional[Dict[str, Any]] = None,
        fork_ranks: int = 0,
    ):
        self.pool_dir, self.env, self.owner = str(pool_dir), dict(env or {}), dict(owner or {})
        self.fork_ranks = fork_ranks

    def __call__(self) -> Dict[str, Any]:
        os.environ.update(self.env)
        from orchestrator.runtime.start.job import exit_fast_after_success, whoami

        done = exit_fast_after_success()
        from orchestrator.runtime.rank import startup
        from orchestrator.runtime.start.forked import preload

        startup.keep_out(wandb=True)  # a trial logging to W&B lets it in (runtime.training.metrics)
        if startup.on_cpu("auto"):  # a pool on a machine without GPUs
            startup.jit_fuser_off()
        preload()
        trials = self._zygote() if self.fork_ranks > 1 else self._serve(whoami()[0])
        done()
        return {"trials": trials}

    def _zygote(self) -> int:
        """Fork ``fork_ranks`` fresh ranks per trial and wait for them; returns how many trials ran."""
        import gc

        import submitit

        from orchestrator.runtime.rank.distributed import LOCAL_PORT_VAR, reserve_local_port
        from orchestrator.runtime.rank.process import resident_file_pages
        from orchestrator.runtime.start.forked import fork_child

        env = submitit.JobEnvironment()
        log_dir, job_id, pool_dir, num = Path(env.paths.stdout).parent, str(env.job_id), Path(self.pool_dir), 0
        gc.collect()
        gc.freeze()  # the children's collector leaves the imported objects alone: fewer copy-on-write copies
        while True:
            spec = _next_trial(pool_dir, num, self.owner)
            if spec is None:
                return num
            ranks_env = {LOCAL_PORT_VAR: str(reserve_local_port())}
            pages = resident_file_pages()
            pids = [
                fork_child(
                    rank,
                    self.fork_ranks,
                    ranks_env,
                    None if rank == 0 else str(log_dir / f"{job_id}_{rank}_log"),
                    pages,
                    lambda rank=rank, num=num, spec=spec: self._forked_trial(spec, num, rank),
                )
                for rank in range(self.fork_ranks)
            ]
            for pid in pids:
                os.waitpid(pid, 0)
            num += 1

    def _forked_trial(self, spec: Dict[str, Any], num: int, rank: int) -> None:
        """Rank ``rank`` of trial ``num`` in a forked process (rank 0 keeps the task's own log)."""
        from orchestrator.io import write_atomic

        write_atomic(pid_path(self.pool_dir, num, rank), str(os.getpid()))
        print(f"warm trial {num}: rank {rank} of {self.fork_ranks} forked (pid {os.getpid()})", flush=True)
        watch_launcher(self.owner, request_stop)  # a dead launcher stops the trial (saving), then the pool
        try:
            summaries = self._trial(spec, rank)
        except BaseException:
            write_atomic(error_path(self.pool_dir, num, rank), traceback.format_exc())
            raise
        if rank == 0:
            write_atomic(result_path(self.pool_dir, num), json.dumps({"summaries": summaries}, default=str))
        else:  # outlive the trial's result: the launcher takes a rank gone before it for a death
            deadline = time.monotonic() + 60.0
            while not result_path(self.pool_dir, num).exists() and time.monotonic() < deadline:
                time.sleep(POLL_S)

    def _serve(self, rank: int) -> int:
        """Run trials until the stop file; returns how many ran (raises what a trial raised)."""
        from orchestrator.io import write_atomic
        from orchestrator.runtime.rank.distributed import shutdown

        pool_dir, num = Path(self.pool_dir), 0
        try:
            while True:
                spec = _next_trial(pool_dir, num, self.owner)
                if spec is None:
                    break
                try:
                    summaries = self._trial(spec, rank)
                except BaseException:
                    write_atomic(error_path(pool_dir, num, rank), traceback.format_exc())
                    raise
                if rank == 0:
                    write_atomic(result_path(pool_dir, num), json.dumps({"summaries": summaries}, default=str))
                num += 1
        finally:
            shutdown()
        return num

    @staticmethod
    def _trial(spec: Dict[str, Any], rank: int) -> list:
        """Run one trial on this rank; rank 0 gets every rank's summary (others: [])."""
        import torch

        from orchestrator.config.layout import ParallelLayout
        from orchestrator.config.schema import from_dict
        from orchestrator.data.prepare import PreparedData
        from orchestrator.runtime.start.job import hold_run_lock
        from orchestrator.runtime.training.run import run
        from orchestrator.runtime.training.summary import reset_peak_memory

        cfg, prepared = from_dict(spec["config"]), PreparedData(**spec["prepared"])
        _sample_indices(cfg, prepared, rank)
        reset_peak_memory("cuda" if cfg.training.device != "cpu" and torch.cuda.is_available() else "cpu")
        with hold_run_lock(cfg.run.dir, since=float(spec["time"]) - 1.0):
            summary = run(cfg, prepared, ParallelLayout(**spec["layout"]), keep_process_group=True)
        gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
        torch.distributed.gather_object(summary, gathered, dst=0)
        return list(gathered or [])
