"""The callable every submitted task runs (pickled by submitit; imports torch only when called).

The run lock lives with the job: before anything starts (no torch import, no process group), the
job's rank 0 takes :class:`~orchestrator.ckpt.lock.RunLock` on ``run.dir`` and holds it until the
job ends — local or SLURM, waited on or detached. It writes its decision to
``<run.dir>/submitit/<job_id>_lock.json`` (atomically; with the SLURM attempt number), and every
other rank waits for that file (at most :data:`DECISION_TIMEOUT_S`) before it joins the process
group. A refused job therefore stops on every rank at once with the same one-line error naming the
holder, and trains nothing; no rank is left waiting in a collective. A job that is requeued keeps
the lock: its next attempt (same SLURM job id) takes it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from orchestrator.slurm import JOB_ID_VAR

DECISION_TIMEOUT_S = 300.0
"""How long a rank other than 0 waits for rank 0's lock decision (rank 0 takes seconds; a
``squeue`` call per stale check is bounded at 15 s)."""


def lighten_imports(config: Dict[str, Any]) -> None:
    """Before torch and megatron-core are imported: keep out of this process what a rank never uses
    (transformers; wandb unless the run logs to W&B) and, on CPU, megatron's ``torch.compile`` jit fuser
    (:mod:`orchestrator.runtime.rank.startup`)."""
    from orchestrator.runtime.rank import startup

    startup.keep_out(wandb=not config["logging"]["wandb"]["project"])
    if startup.on_cpu(config["training"]["device"]):
        startup.jit_fuser_off()


class TrainJob:
    """``TrainJob(config_dict, prepared_dict, layout_dict, env, fork_ranks)()`` trains one rank and returns its summary.

    Plain data travels (dicts), not OmegaConf objects, so the pickle is small and
    version-independent; the job rebuilds the typed :class:`JobConfig`. ``layout``: the launcher's validated
    :class:`~orchestrator.config.layout.ParallelLayout` as a dict (``dataclasses.asdict``): every rank trains on
    that value and never derives the layout again (a ``cluster.hostfile`` may exist only on the launcher's machine). ``env`` is
    applied before torch is imported (thread counts, NCCL settings). ``fork_ranks`` = N > 1 (local
    CPU jobs, submitted as one task): this task imports torch and megatron-core once, forks ranks
    1..N-1 (:mod:`orchestrator.runtime.start.forked`) and trains as rank 0; each forked rank writes its
    own submitit result file. ``build_indices`` (a job of one task): build GPTDataset's sample indices
    first, when the cache lacks them (:func:`orchestrator.runtime.rank.dataset.cache_indices`).
    ``launcher``: the waiting launcher's identity (a local job with ``cluster.wait``): the task stops
    gracefully when it dies (:mod:`orchestrator.runtime.faults.launcher`; forked ranks die with the task).
    """

    def __init__(
        self,
        config: Dict[str, Any],
        prepared: Dict[str, Any],
        layout: Dict[str, Any],
        env: Optional[Dict[str, str]] = None,
        fork_ranks: int = 0,
        build_indices: bool = False,
        launcher: Optional[Dict[str, Any]] = None,
    ):
        self.config = config
        self.prepared = prepared
        self.layout = layout
        self.env = dict(env or {})
        self.fork_ranks = fork_ranks
        self.build_indices = build_indices
        self.launcher = launcher

    def _watch_launcher(self) -> None:
        """The launcher's death (a waited local job) and, on rank 0, a stop asked of the job
        (``orchestrator stop``, a signal to the launcher): both ask the graceful stop."""
        from orchestrator.runtime.faults.launcher import watch_launcher, watch_stop
        from orchestrator.runtime.faults.preempt import request_stop

        watch_launcher(self.launcher, request_stop)
        rank, job_id, _ = whoami()
        if rank == 0 and job_id is not None:
            watch_stop(self.config["run"]["dir"], job_id, request_stop)

    def __call__(self) -> Dict[str, Any]:
        from orchestrator.runtime.rank import startup

        startup.pause_collector()  # back on before the training loop (runtime.training.run)
        os.environ.update(self.env)
        lighten_imports(self.config)
        done = exit_fast_after_success()
        self._report_up()
        if self.fork_ranks <= 1:
            self._watch_launcher()  # a forking task starts it after forking its ranks (from a thread-free process)
        if self.build_indices:  # the job's one task, before any rank trains (the launcher left it, see submit.executor)
            from orchestrator.config.schema import from_dict
            from orchestrator.data.prepare import PreparedData, indices_cached
            from orchestrator.meter import say
            from orchestrator.runtime.rank.dataset import cache_indices

            cfg, prepared = from_dict(self.config), PreparedData(**self.prepared)
            if not indices_cached(cfg, prepared):
                say("building sample indices (megatron-core GPTDataset)")
                began = time.monotonic()
                cache_indices(cfg, prepared)
                say("sample indices built")
                self._record("data_prepared", seconds=round(time.monotonic() - began, 3))
        summary = self._train_forked() if self.fork_ranks > 1 else self._train()
        done()
        return summary

    def _record(self, event: str, **fields: Any) -> None:
        """A job event in ``jobs.jsonl`` (the goodput account reads them); a failed write never stops a rank."""
        from orchestrator.ckpt.history import record_event

        _, job_id, attempt = whoami()
        try:
            record_event(self.config["run"]["dir"], event, job_id=job_id, attempt=attempt, **fields)
        except OSError:
            pass

    def _report_up(self) -> None:
        """This rank's process has started (before torch is imported): the launcher counts these."""
        from orchestrator.ckpt.rundir import started_path
        from orchestrator.io import write_atomic

        rank, job_id, _ = whoami()
        try:
            write_atomic(started_path(self.config["run"]["dir"], rank), f"{job_id}\n", fsync=False)
        except OSError:  # a progress display must never stop a rank
            return
        if rank == 0:  # the end of the queue wait in the run's goodput account (ckpt.goodput)
            self._record("job_running")
        if rank == 0 and self.fork_ranks > 1:
            from orchestrator.meter import say

            say(f"rank 0 up: importing torch and megatron-core, then forking ranks 1..{self.fork_ranks - 1}")

    def _train_forked(self) -> Dict[str, Any]:
        """Fork ranks 1..N-1, train as rank 0, wait for the forks; a fork killed by a signal is named."""
        from orchestrator.errors import RunLockedError
        from orchestrator.runtime.start import forked

        pids = forked.fork_ranks(self.fork_ranks, self._forked_rank)
        self._watch_launcher()
        from orchestrator.meter import say

        say(f"ranks 1..{self.fork_ranks - 1} forked; joining the process group")
        try:  # an exception ends this process, and the forked ranks die with it
            summary = self._train()
        except SystemExit:  # a graceful stop or requeue: every rank stops after the same iteration
            forked.reap(pids)
            raise
        except RunLockedError:  # the forks read the refusal rank 0 wrote and end with it: let them write their
            forked.reap(pids)  # results (this process's exit would kill a fork that has not read it yet)
            raise
        except Exception as exc:  # a peer killed (OOM killer, kill -9) breaks rank 0's collective: name it
            killed = forked.killed_ranks(pids)
            if killed:
                from orchestrator.errors import RanksDiedError, ranks_died

                signals = "; ".join(sorted(set(killed.values())))
                raise RanksDiedError(f"{ranks_died(killed, signals)}; the other ranks were stopped") from exc
            raise
        forked.reap(pids)
        return summary

    def _train(self) -> Dict[str, Any]:
        from orchestrator.config.layout import ParallelLayout
        from orchestrator.config.schema import from_dict

        cfg = from_dict(self.config)
        with hold_run_lock(cfg.run.dir):
            from orchestrator.data.prepare import PreparedData
            from orchestrator.runtime.training.run import run

            try:
                return run(cfg, PreparedData(**self.prepared), ParallelLayout(**self.layout))
            except (Exception, SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:  # e.g. torch's CheckpointException: submitit (and a forked rank) catch
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc  # Exception only, and write no result

    def _forked_rank(self) -> None:
        """A forked rank: train, then write the result file as submitit writes a task's
        (``("success", summary)`` or ``("error", traceback)``)."""
        import traceback

        import submitit
        from submitit.core import utils

        result = submitit.JobEnvironment().paths.result_pickle
        self._report_up()
        try:
            outcome: Tuple[str, Any] = ("success", self._train())
        except Exception:
            traceback.print_exc()
            outcome = ("error", traceback.format_exc())
        with utils.temporary_save_path(result) as tmp:
            utils.cloudpickle_dump(outcome, tmp)
        if outcome[0] == "error":
            raise SystemExit(1)


def exit_fast_after_success() -> "Callable[[], None]":
    """Skip the interpreter's own teardown once a task has succeeded; returns the call that says so.

    With torch and megatron-core loaded, Python's finalization (module teardown, garbage collection)
    costs ~1.5 s of CPU per process (measured on this project's CI machine), paid by every rank
    while the launcher waits for the job to end. Registered before anything else, this handler runs
    after every other ``atexit`` handler (logging, TensorBoard, W&B, torch all run theirs), then
    ends the process with status 0 -- only when the task function returned and submitit has
    written this task's result file. A failed task exits the normal way.
    """
    import atexit
    import sys

    state = {"ok": False}
    try:
        import submitit

        result = Path(submitit.JobEnvironment().paths.result_pickle)
    except RuntimeError:  # not in a submitit task
        return lambda: None

    def _exit() -> None:
        if state["ok"] and result.exists():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    atexit.register(_exit)
    return lambda: state.update(ok=True)


def whoami() -> Tuple[int, Optional[str], int]:
    """(global rank, job id, SLURM attempt) from submitit's job environment; (RANK or 0,
    ORCHESTRATOR_JOB_ID or None, 0) outside a submitit job."""
    import submitit

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun's agent: its RANK, not the agent's task
        from orchestrator.slurm import restart_count  # (an agent started as a SLURM job's task: its attempt)

        return int(os.environ.get("RANK", "0")), os.environ.get(JOB_ID_VAR), restart_count()
    try:
        env = submitit.JobEnvironment()
    except RuntimeError:  # torchrun's worker (runtime.start.agent: its job id) or a bare process
        return int(os.environ.get("RANK", "0")), os.environ.get(JOB_ID_VAR), 0
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    return env.global_rank, str(env.job_id), int(attempt) if attempt.isdigit() else 0


def decision_path(run_dir: "str | os.PathLike", job_id: str) -> Path:
    """Where rank 0 of job ``job_id`` writes its lock decision (:func:`orchestrator.ckpt.lock.decision_path`)."""
    from orchestrator.ckpt import lock

    return lock.decision_path(run_dir, job_id)


@contextlib.contextmanager
def hold_run_lock(run_dir: str, since: Optional[float] = None) -> Iterator[None]:
    """Rank 0: take the run lock (RunLockedError naming the holder when a live run has it), publish
    the decision, hold the lock for the block and release it after (not when the job is requeued).
    Other ranks: wait for the decision and raise the same RunLockedError when it is a refusal.
    ``since``: read only a decision written after this time (default: this process's start; a warm
    rank passes its trial's start)."""
    from orchestrator.ckpt.lock import RunLock
    from orchestrator.errors import RunLockedError
    from orchestrator.io import write_atomic
    from orchestrator.runtime.faults.preempt import Requeued

    rank, job_id, attempt = whoami()
    if rank != 0:
        if job_id is not None:
            _await_decision(decision_path(run_dir, job_id), attempt, since=since)
        yield
        return
    lock = RunLock(run_dir)
    decision: Dict[str, Any] = {"job_id": job_id, "attempt": attempt, "time": time.time()}
    try:
        lock.acquire()
    except RunLockedError as exc:
        if job_id is not None:
            write_atomic(decision_path(run_dir, job_id), json.dumps({**decision, "ok": False, "error": str(exc)}))
            from orchestrator.ckpt.history import record_event

            record_event(run_dir, "lock_refused", job_id=job_id, attempt=attempt, holder=lock.holder())
        raise
    if job_id is not None:
        write_atomic(decision_path(run_dir, job_id), json.dumps({**decision, "ok": True}))
    requeued = False
    try:
        yield
    except Requeued:
        requeued = True  # the next attempt of this job takes the lock over
        raise
    finally:
        if not requeued:
            lock.release()


def _await_decision(
    path: Path, attempt: int, timeout_s: float = DECISION_TIMEOUT_S, since: Optional[float] = None
) -> None:
    """Wait for rank 0's decision of this attempt (written after this process started, so a file
    left by an earlier job that had the same id is never read); raise its refusal."""
    import psutil

    from orchestrator.errors import RunLockedError

    # ranks start within seconds of each other (a warm rank's trials: within seconds of the trial file)
    started = psutil.Process().create_time() - 60.0 if since is None else since
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            decision = json.loads(path.read_text())
        except (OSError, ValueError):
            decision = None
        if decision and decision.get("attempt") == attempt and float(decision.get("time", 0)) >= started:
            if not decision.get("ok"):
                raise RunLockedError(decision.get("error") or "rank 0 could not take the run lock")
            return
        time.sleep(0.2)
    raise RunLockedError(
        f"rank 0 did not decide on the run lock within {timeout_s:.0f} s ({path} not written); fix: see rank 0's log"
    )
